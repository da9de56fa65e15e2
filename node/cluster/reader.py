"""`ClusterReader`: the part of `node.cluster.service.ClusterService` most modules read (who this node is,
the replicated state, the membership view), as a Protocol, so that they need not import the
service (and libp2p) and tests can hand them a plain object."""

from __future__ import annotations

from typing import Protocol

from protocol.cluster import ClusterState
from protocol.ids import NodeId
from protocol.membership import View


class ClusterReader(Protocol):
    @property
    def me(self) -> NodeId: ...
    @property
    def state(self) -> ClusterState: ...
    @property
    def view(self) -> View: ...

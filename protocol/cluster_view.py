"""What `GET /v1/cluster` answers and `shoal status` shows: one node's picture of the cluster.

A read-only snapshot built by the node from its cluster state, failure detector and election; the
API serialises it, the CLI renders it. Times are relative ("seconds ago") so no clocks are compared.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

MemberStatus = Literal["unknown", "alive", "suspect", "dead", "left"]
Role = Literal["leader", "follower"]


class _View(BaseModel):
    model_config = ConfigDict(frozen=True)


class MemberView(_View):
    id: str
    host: str
    role: Role
    status: MemberStatus
    backend: str
    os: str
    memory_total: int
    memory_available: int
    last_seen_s: float | None
    """Seconds since this node last heard from the member; None for the answering node itself."""
    api_url: str
    version: str
    multiaddrs: tuple[str, ...]


class StageView(_View):
    node_id: str
    start_layer: int
    end_layer: int


class InstanceView(_View):
    id: str
    model: str
    stages: tuple[StageView, ...]


class ClusterView(_View):
    cluster: str
    self: str
    leader: str | None
    term: int
    members: tuple[MemberView, ...]
    instances: tuple[InstanceView, ...]

"""Identifiers used across the node, the runner and the API."""

from __future__ import annotations

import secrets
from typing import NewType

RequestId = NewType("RequestId", str)
ModelId = NewType("ModelId", str)


def new_request_id(prefix: str) -> RequestId:
    """A request id unique enough to key in-flight requests, with its surface's prefix
    (`chatcmpl-` for chat completions, `msg_` for Claude Messages, `resp_` for Responses)."""
    return RequestId(f"{prefix}{secrets.token_hex(12)}")


NodeId = NewType("NodeId", str)
"""A node's libp2p peer id as text ("12D3KooW..."): stable across restarts when the key is kept on disk."""

InstanceId = NewType("InstanceId", str)
"""One placement of a model on the cluster, chosen by the leader that creates it."""

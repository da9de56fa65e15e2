"""Identifiers used across the node, the runner and the API."""

from __future__ import annotations

import secrets
from typing import NewType

RequestId = NewType("RequestId", str)
ModelId = NewType("ModelId", str)


def new_request_id() -> RequestId:
    """An OpenAI-looking completion id, unique enough to key in-flight requests."""
    return RequestId(f"chatcmpl-{secrets.token_hex(12)}")

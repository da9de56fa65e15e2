"""What `GET /v1/cluster` answers and `shoal status` shows: one node's picture of the cluster.

A read-only snapshot built by the node from its cluster state, failure detector and election; the
API serialises it, the CLI renders it. Times are relative ("seconds ago") so no clocks are compared.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from protocol.health import RunnerState
from protocol.manifest import TransferProgress
from protocol.sharding import Sharding

MemberStatus = Literal["unknown", "alive", "suspect", "dead", "left"]
Role = Literal["leader", "follower"]
InstanceState = Literal["loading", "ready", "failed", "unknown"]
"""How an instance is doing as its first stage's node reports it (placing happens before a record
exists, so only a client that asked can show it)."""


class _View(BaseModel):
    model_config = ConfigDict(frozen=True)


class HoldingView(_View):
    manifest_id: str
    files: int | None = None
    """How many of the manifest's files the member holds; None: all of them."""
    model: str = ""
    """The name the member serves the model's files under (empty from an older node)."""


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
    models: tuple[HoldingView, ...] = ()
    """The models whose files this member serves to the others."""
    transfers: tuple[TransferProgress, ...] = ()
    """Model files moving to this member now, and the latest finished moves (oldest first)."""
    round_trips_us: dict[str, int] = {}
    """Round trips this member measured to its peers (by node id), in microseconds ("auto" sharding
    decides on them)."""


class StageView(_View):
    node_id: str
    start_layer: int
    end_layer: int


class LoadView(_View):
    """An instance's load as its entry node (the first stage's) reports it."""

    ready: bool
    """Its runner takes requests; requests go to the least loaded ready replica of a model."""
    runner: RunnerState | None = None
    """Its runner's state (None: no runner yet: its files or later stages are still coming)."""
    error: str | None = None
    """Why the runner failed or restarts."""
    active: int
    """Requests in its runner now, running or waiting."""
    queued: int
    """Of those, the ones waiting for a place in the batch."""
    served: int
    """Requests it took since its node started."""


class InstanceView(_View):
    id: str
    model: str
    stages: tuple[StageView, ...]
    """Pipeline stages in layer order; for "tensor" sharding the ranks in rank order (every layer each)."""
    sharding: Sharding = "pipeline"
    manifest_id: str | None = None
    """The content id of the model's files (`protocol.manifest`), which stage nodes fetch by."""
    state: InstanceState | None = None
    """From the stage nodes' transfers: "loading" while files move, "failed" when the latest transfer
    failed (retried after a backoff; `error` says why); None when they say nothing (the runners tell)."""
    error: str | None = None
    load: LoadView | None = None
    """None until its entry node has reported (or when the view was built without loads)."""


class ClusterView(_View):
    cluster: str
    self: str
    leader: str | None
    term: int
    members: tuple[MemberView, ...]
    instances: tuple[InstanceView, ...]


class InstanceStatusView(_View):
    """What the dashboard shows of an instance beside its placement."""

    state: InstanceState
    error: str | None = None
    """Why it failed, is restarting or cannot be asked; None when there is nothing to say."""


class ModelFileView(_View):
    """A model in a node's data dir (what `shoal models` lists), which that node can place by name."""

    name: str
    model_type: str
    size_bytes: int

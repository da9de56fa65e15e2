"""What a node reports of itself at `GET /health`: its runners and its counters, typed.

Other nodes read it over HTTP (the dashboard's instance states), the API reads it for metrics, and
replica choice reads the queue depth: a field renamed or retyped at the producer now breaks its
readers' type check, not a dict lookup at run time in another process.
"""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict

RunnerState = Literal["starting", "ready", "restarting", "failed"]
"""A runner's life (`node.runner.supervisor`): loading, serving, loading again after a crash, or
given up (its `error` says why)."""
RUNNER_STATES: tuple[RunnerState, ...] = get_args(RunnerState)


class RunnerHealth(BaseModel):
    """One runner of the node (a model it serves, or the first stage of a split one)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    model: str
    state: RunnerState
    pid: int | None = None
    restarts: int = 0
    active_requests: int = 0
    queued_requests: int = 0
    """In flight past what the runner decodes at once: waiting for a place in its batch."""
    cancelled: int = 0
    context_length: int | None = None
    error: str | None = None


Counters = dict[str, int]


class NodeHealth(BaseModel):
    """The body of `GET /health` (besides `"status": "ok"`)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    runners: tuple[RunnerHealth, ...] = ()
    cluster: Counters = {}
    """Gossip counters (`node.cluster.service.ClusterStats`)."""
    mesh: Counters = {}
    """Connection and admission counters (`node.net.events.MeshStats`)."""
    generations_for_peers: Counters = {}
    """Generations this node ran for other nodes (`node.serving.routing.ServerStats`)."""

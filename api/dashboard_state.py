"""What the dashboard shows beyond `GET /v1/cluster`: each instance's state and the placeable models.

An instance's state is its entry runner's, which the entry node gossips with its load
(`protocol.cluster_records.EntryLoad`), so every node reads it from its own view of the cluster:
no node asks another over HTTP, and a node whose entry is gone says "unknown". Which models can be
placed comes from the backend's data dir (`Backend.local_models`) and whether each fits from the
leader's preview, the same one `GET /v1/instances/preview` asks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import trio

from api.backend import Backend
from protocol.cluster_view import ClusterView, InstanceStatusView, InstanceView, LoadView
from protocol.control_wire import Exists, Invalid, NotFound, Placed, PlaceOutcome, Unavailable
from protocol.health import RunnerState

PREVIEW_TIMEOUT_S = 10.0
"""A preview reads the model's shape (a config.json) and asks the leader: seconds at worst."""

_RUNNER_STATES: Mapping[RunnerState, InstanceStatusView] = {
    "ready": InstanceStatusView(state="ready"),
    "starting": InstanceStatusView(state="loading"),
    "restarting": InstanceStatusView(state="loading", error="the runner is restarting"),
}
_GONE = ("dead", "left", "unknown")
"""Member states of an entry node that can no longer report its instance's runner."""


def instance_status(instance: InstanceView, entry_status: str = "alive") -> InstanceStatusView:
    """The state of `instance`: what its files say while they move or after they failed to
    (`InstanceView.state`), unless its runner is ready; else what its entry node reported of its
    runner (`entry_status`: that node's member status here). No runner yet means its files are
    being resolved (an import or a download) or its later stages are starting: still loading."""
    status = _runner_status(instance.load, entry_status)
    if instance.state is not None and status.state != "ready":
        return InstanceStatusView(state=instance.state, error=instance.error)
    return status


def _runner_status(load: LoadView | None, entry_status: str) -> InstanceStatusView:
    if entry_status in _GONE:
        return InstanceStatusView(state="unknown", error=f"its first node is {entry_status}")
    if load is None or load.runner is None:
        return InstanceStatusView(state="loading")
    if load.runner == "failed":
        return InstanceStatusView(state="failed", error=load.error or "the model failed")
    return _RUNNER_STATES[load.runner]


def instance_states(view: ClusterView) -> dict[str, InstanceStatusView]:
    """Each placed instance's `InstanceStatusView`, from `view` alone."""
    members = {m.id: m.status for m in view.members}
    return {
        instance.id: instance_status(instance, members.get(instance.stages[0].node_id, "unknown"))
        for instance in view.instances
        if instance.stages
    }


def _fit(outcome: PlaceOutcome | None) -> dict[str, Any]:
    """A preview's answer as the model list shows it: fits (on how many nodes), or why not."""
    match outcome:
        case Placed() | Exists():
            stages = outcome.instance.stages
            stage_bytes = list(outcome.stage_bytes) if isinstance(outcome, Placed) else []
            return {"fits": True, "nodes": len(stages), "stage_bytes": stage_bytes, "reason": None}
        case Invalid() | NotFound():
            return {"fits": False, "nodes": None, "stage_bytes": [], "reason": outcome.reason}
        case Unavailable():
            return {"fits": None, "nodes": None, "stage_bytes": [], "reason": outcome.reason}
        case None:
            return {"fits": None, "nodes": None, "stage_bytes": [], "reason": "the preview timed out"}
        case _:
            return {"fits": None, "nodes": None, "stage_bytes": [], "reason": "unexpected answer"}


async def placeable_models(backend: Backend) -> list[dict[str, Any]]:
    """The models in the backend's data dir, each with its size and the leader's preview of it."""
    models = list(await backend.local_models())
    fits: dict[str, dict[str, Any]] = {}

    async def preview(name: str) -> None:
        outcome: PlaceOutcome | None = None
        with trio.move_on_after(PREVIEW_TIMEOUT_S):
            outcome = await backend.place_instance(name, None, preview=True)
        fits[name] = _fit(outcome)

    async with trio.open_nursery() as nursery:
        for model in models:
            nursery.start_soon(preview, model.name)
    return [{**model.model_dump(mode="json"), **fits[model.name]} for model in models]

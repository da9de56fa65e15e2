"""What the dashboard shows beyond `GET /v1/cluster`: each instance's state and the placeable models.

An instance's state lives in the runner of its first stage's node, which only that node knows: this
node asks it over HTTP (`GET <api_url>/health`, the URL every node gossips in its profile), at most
once per `HEALTH_TTL_S` however many pages watch, and answers for itself without asking. A node that
does not answer in `HEALTH_TIMEOUT_S` makes its instances "unknown", never a hang. Which models can
be placed comes from the backend's data dir (`Backend.local_models`) and whether each fits from the
leader's preview, the same one `GET /v1/instances/preview` asks.
"""

from __future__ import annotations

import functools
import logging
import urllib.request
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import trio

from api.backend import Backend
from protocol.cluster_view import ClusterView, InstanceStatusView, InstanceView
from protocol.control_wire import Exists, Invalid, NotFound, Placed, PlaceOutcome, Unavailable
from protocol.health import NodeHealth, RunnerHealth, RunnerState

log = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 1.5
"""A peer's `/health` answers in milliseconds on a LAN; one that takes longer is busy or gone, and the
page should say "unknown" rather than freeze its push."""
HEALTH_TTL_S = 1.0
"""A peer's answer is reused this long: the page refreshes about once a second, so N open pages cost
a peer one request a second, not N."""
PREVIEW_TIMEOUT_S = 10.0
"""A preview reads the model's shape (a config.json) and asks the leader: seconds at worst."""
MAX_HEALTH_BYTES = 1024 * 1024
"""A `/health` body is a few KB; a peer sending more is not read further."""

_RUNNER_STATES: Mapping[RunnerState, InstanceStatusView] = {
    "ready": InstanceStatusView(state="ready"),
    "starting": InstanceStatusView(state="loading"),
    "restarting": InstanceStatusView(state="loading", error="the runner is restarting"),
}
Runners = Sequence[RunnerHealth]


def instance_status(instance: InstanceView, runners: Runners | None) -> InstanceStatusView:
    """The state of `instance`: what its files say while they move or after they failed to
    (`InstanceView.state`), unless its runner is ready; else what the runners its first stage's node
    reports say (None: it did not answer). No runner for the model yet means its files are being
    resolved (an import or a download) or its later stages are starting: still loading."""
    status = _runner_status(instance, runners)
    if instance.state is not None and status.state != "ready":
        return InstanceStatusView(state=instance.state, error=instance.error)
    return status


def _runner_status(instance: InstanceView, runners: Runners | None) -> InstanceStatusView:
    if runners is None:
        return InstanceStatusView(state="unknown", error="its first node's API does not answer")
    for runner in runners:
        if runner.model != instance.model:
            continue
        if runner.state == "failed":
            return InstanceStatusView(state="failed", error=runner.error or "the model failed")
        return _RUNNER_STATES[runner.state]
    return InstanceStatusView(state="loading")


def _get_runners(url: str) -> Runners:
    """Blocking: a peer's `/health` runners."""
    with urllib.request.urlopen(f"{url}/health", timeout=HEALTH_TIMEOUT_S) as answer:
        return NodeHealth.model_validate_json(answer.read(MAX_HEALTH_BYTES)).runners


async def fetch_runners(url: str) -> Runners:
    """A peer's `/health` runners, read in a worker thread; one stuck past the timeout is abandoned."""
    fetch = functools.partial(trio.to_thread.run_sync, _get_runners, url)
    return await fetch(abandon_on_cancel=True)  # type: ignore[call-arg]  # trio-typing's stubs are older


class InstanceStates:
    """Each instance's `InstanceStatusView`, from the runners of the node that holds its first stage."""

    def __init__(
        self,
        backend: Backend,
        *,
        fetch: Callable[[str], Awaitable[Runners]] = fetch_runners,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        self._backend = backend
        self._fetch = fetch
        self._clock = clock
        self._cache: dict[str, tuple[float, Runners | None]] = {}
        self._locks: dict[str, trio.Lock] = {}

    async def of(self, view: ClusterView) -> dict[str, InstanceStatusView]:
        entries = {instance.stages[0].node_id for instance in view.instances if instance.stages}
        urls = {m.id: m.api_url for m in view.members}
        runners: dict[str, Runners | None] = {}

        async def ask(node: str) -> None:
            runners[node] = await self._runners(node, view.self, urls.get(node, ""))

        async with trio.open_nursery() as nursery:
            for node in entries:
                nursery.start_soon(ask, node)
        return {
            instance.id: instance_status(instance, runners.get(instance.stages[0].node_id))
            for instance in view.instances
            if instance.stages
        }

    async def _runners(self, node: str, me: str, url: str) -> Runners | None:
        if node == me:
            return self._backend.health().runners
        if not url.startswith(("http://", "https://")):
            return None
        async with self._locks.setdefault(node, trio.Lock()):
            cached = self._cache.get(node)
            if cached is not None and self._clock() - cached[0] < HEALTH_TTL_S:
                return cached[1]
            result: Runners | None = None
            with trio.move_on_after(HEALTH_TIMEOUT_S + 0.5):
                try:
                    result = await self._fetch(url)
                except (OSError, ValueError) as exc:  # refused, timed out, not JSON: say "unknown"
                    log.debug("dashboard: %s/health did not answer: %s", url, exc)
            self._cache[node] = (self._clock(), result)
            return result


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

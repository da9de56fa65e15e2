"""The dashboard's server side without a browser: instance states from runners, peers asked at most
once a second and never waited on past a timeout, and the model list's fit from the leader's preview."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import trio
import trio.testing

from api.dashboard_state import InstanceStates, instance_status, placeable_models
from protocol.cluster_view import ClusterView, InstanceView, MemberView, ModelFileView, StageView
from protocol.control_wire import Invalid, Placed, PlaceOutcome, Unavailable
from protocol.health import NodeHealth, RunnerHealth

ME, PEER = "12D3KooWme", "12D3KooWpeer"


def instance(iid: str, model: str, node: str) -> InstanceView:
    return InstanceView(id=iid, model=model, stages=(StageView(node_id=node, start_layer=0, end_layer=2),))


def member(node: str) -> MemberView:
    return MemberView(
        id=node,
        host="h",
        role="follower",
        status="alive",
        backend="cpu",
        os="linux",
        memory_total=8,
        memory_available=4,
        last_seen_s=None,
        api_url=f"http://{node}.test:1",
        version="0",
        multiaddrs=(),
    )


RUNNER = RunnerHealth(model="m", state="ready")


def runner(**fields: Any) -> RunnerHealth:
    return RUNNER.model_copy(update=fields)


@pytest.mark.parametrize(
    ("runners", "state", "error"),
    [
        (None, "unknown", "its first node's API does not answer"),
        ([], "loading", None),
        ([runner(model="other")], "loading", None),
        ([RUNNER], "ready", None),
        ([runner(state="starting")], "loading", None),
        ([runner(state="restarting")], "loading", "the runner is restarting"),
        ([runner(state="failed", error="out of memory")], "failed", "out of memory"),
        ([runner(state="failed")], "failed", "the model failed"),
    ],
)
def test_instance_status_from_runners(
    runners: list[RunnerHealth] | None, state: str, error: str | None
) -> None:
    status = instance_status(instance("i", "m", ME), runners)
    assert (status.state, status.error) == (state, error)


def test_what_the_files_say_counts_until_the_runner_is_ready() -> None:
    moving = instance("i", "m", ME).model_copy(update={"state": "failed", "error": "no peer has the files"})
    assert instance_status(moving, []).model_dump() == {"state": "failed", "error": "no peer has the files"}
    assert instance_status(moving, None).state == "failed"
    assert instance_status(moving, [RUNNER]).state == "ready"


class FakeBackend:
    def __init__(self, outcomes: dict[str, PlaceOutcome | None] | None = None) -> None:
        self.view = ClusterView(
            cluster="c",
            self=ME,
            leader=ME,
            term=1,
            members=(member(ME), member(PEER)),
            instances=(instance("here", "a", ME), instance("there", "b", PEER)),
        )
        self.outcomes = outcomes or {}

    def cluster(self) -> ClusterView:
        return self.view

    def health(self) -> NodeHealth:
        return NodeHealth(runners=(RunnerHealth(model="a", state="ready"),))

    async def local_models(self) -> Sequence[ModelFileView]:
        return [ModelFileView(name=name, model_type="llama", size_bytes=10) for name in self.outcomes]

    async def place_instance(
        self, model: str, nodes: int | None, *, preview: bool, replicas: int | None = None
    ) -> PlaceOutcome:
        assert preview
        outcome = self.outcomes[model]
        if outcome is None:
            await trio.sleep_forever()
        assert outcome is not None
        return outcome


def test_peers_are_asked_once_per_ttl_and_a_silent_one_is_unknown() -> None:
    asked: list[str] = []
    answers: dict[str, Any] = {"b": "ready"}

    async def fetch(url: str) -> list[RunnerHealth]:
        asked.append(url)
        if answers["b"] is None:
            raise OSError("connection refused")
        return [RunnerHealth(model="b", state=answers["b"])]

    async def main() -> None:
        backend = FakeBackend()
        states = InstanceStates(backend, fetch=fetch)  # type: ignore[arg-type]
        first = await states.of(backend.view)
        assert {k: v.state for k, v in first.items()} == {"here": "ready", "there": "ready"}
        answers["b"] = None
        await states.of(backend.view)  # within the TTL: the cached answer, not a second request
        assert asked == [f"http://{PEER}.test:1"]
        await trio.sleep(1.5)
        later = await states.of(backend.view)
        assert later["there"].state == "unknown" and later["here"].state == "ready"
        assert len(asked) == 2

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_models_list_their_fit_from_the_preview() -> None:
    placed = Placed(instance=instance("x", "fits", ME), stage_bytes=(7,), preview=True)
    backend = FakeBackend(
        {
            "fits": placed,
            "big": Invalid(kind="does_not_fit", reason="needs 9 GB, 4 GB free"),
            "leaderless": Unavailable(kind="no_leader", reason="no leader yet"),
            "slow": None,
        }
    )

    async def main() -> list[dict[str, Any]]:
        return await placeable_models(backend)  # type: ignore[arg-type]

    rows = {row["name"]: row for row in trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))}
    assert rows["fits"] == {
        "name": "fits",
        "model_type": "llama",
        "size_bytes": 10,
        "fits": True,
        "nodes": 1,
        "stage_bytes": [7],
        "reason": None,
    }
    assert (rows["big"]["fits"], rows["big"]["reason"]) == (False, "needs 9 GB, 4 GB free")
    assert (rows["leaderless"]["fits"], rows["leaderless"]["reason"]) == (None, "no leader yet")
    assert (rows["slow"]["fits"], rows["slow"]["reason"]) == (None, "the preview timed out")

"""The dashboard's server side without a browser: instance states from runners, peers asked at most
once a second and never waited on past a timeout, and the model list's fit from the leader's preview."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import trio
import trio.testing

from api.dashboard_state import instance_states, instance_status, placeable_models
from protocol.cluster_view import ClusterView, InstanceView, LoadView, MemberView, ModelFileView, StageView
from protocol.control_wire import Invalid, Placed, PlaceOutcome, Unavailable
from protocol.health import NodeHealth, RunnerHealth, RunnerState
from protocol.sharding import Sharding

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


def loaded(runner: RunnerState | None, error: str | None = None) -> LoadView:
    return LoadView(ready=runner == "ready", runner=runner, error=error, active=0, queued=0, served=0)


@pytest.mark.parametrize(
    ("load", "entry", "state", "error"),
    [
        (loaded("ready"), "dead", "unknown", "its first node is dead"),
        (None, "alive", "loading", None),
        (loaded(None), "suspect", "loading", None),
        (loaded("ready"), "alive", "ready", None),
        (loaded("starting"), "alive", "loading", None),
        (loaded("restarting"), "alive", "loading", "the runner is restarting"),
        (loaded("failed", "out of memory"), "alive", "failed", "out of memory"),
        (loaded("failed"), "alive", "failed", "the model failed"),
    ],
)
def test_instance_status_from_what_its_entry_gossips(
    load: LoadView | None, entry: str, state: str, error: str | None
) -> None:
    status = instance_status(instance("i", "m", ME).model_copy(update={"load": load}), entry)
    assert (status.state, status.error) == (state, error)


def test_what_the_files_say_counts_until_the_runner_is_ready() -> None:
    moving = instance("i", "m", ME).model_copy(update={"state": "failed", "error": "no peer has the files"})
    assert instance_status(moving).model_dump() == {"state": "failed", "error": "no peer has the files"}
    assert instance_status(moving, "dead").state == "failed"
    assert instance_status(moving.model_copy(update={"load": loaded("ready")})).state == "ready"


def test_every_instance_of_a_view_gets_its_state_without_asking_anyone() -> None:
    view = FakeBackend().view.model_copy(
        update={
            "members": (member(ME), member(PEER).model_copy(update={"status": "dead"})),
            "instances": (
                instance("here", "a", ME).model_copy(update={"load": loaded("ready")}),
                instance("there", "b", PEER).model_copy(update={"load": loaded("ready")}),
                instance("gone", "c", "12D3KooWnever"),
            ),
        }
    )
    assert {k: v.state for k, v in instance_states(view).items()} == {
        "here": "ready",
        "there": "unknown",
        "gone": "unknown",
    }


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
        self,
        model: str,
        nodes: int | None,
        *,
        preview: bool,
        replicas: int | None = None,
        sharding: Sharding = "pipeline",
    ) -> PlaceOutcome:
        assert preview
        outcome = self.outcomes[model]
        if outcome is None:
            await trio.sleep_forever()
        assert outcome is not None
        return outcome


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

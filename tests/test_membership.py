"""The failure detector: transitions as tables, with explicit local times."""

from __future__ import annotations

import pytest

from protocol.cluster import ClusterState
from protocol.cluster_records import Suspicion
from protocol.ids import NodeId
from protocol.membership import (
    FailureDetectorConfig,
    Status,
    Transition,
    View,
    disconnected,
    observe,
    observe_state,
    reconnected,
    tick,
)

CFG = FailureDetectorConfig(suspect_after_s=1.5, dead_after_s=2.5)
"""The tables below are written for these timings (the defaults are longer); the logic is the same."""
N = NodeId("12D3KooWPeer")
ME = NodeId("12D3KooWMe")

# A script is a list of steps at explicit local times:
#   ("beat", t, incarnation, heartbeat) | ("leave", t, incarnation, heartbeat) | ("tick", t)
#   | ("cut", t): its last connection closed | ("reconnect", t): it authenticated a new one
# and the expected status after the last step.
Step = tuple[object, ...]


def run(steps: list[Step], config: FailureDetectorConfig = CFG) -> tuple[View, list[Transition]]:
    view, log = View.empty(), []
    for step in steps:
        match step:
            case ("beat", float(t), int(inc), int(hb)):
                view, changes = observe(view, N, inc, hb, t)
            case ("leave", float(t), int(inc), int(hb)):
                view, changes = observe(view, N, inc, hb, t, left=True)
            case ("tick", float(t)):
                view, changes = tick(view, t, config)
            case ("cut", float(t)):
                view, changes = disconnected(view, N, t), []
            case ("reconnect", float(t)):
                view, changes = reconnected(view, N), []
            case _:
                raise AssertionError(step)
        log += changes
    return view, log


def ticks(start: float, end: float, every: float = 0.25) -> list[Step]:
    count = round((end - start) / every)
    return [("tick", start + i * every) for i in range(count + 1)]


ALIVE_AT_0: list[Step] = [("beat", 0.0, 0, 1), ("beat", 0.0, 0, 2)]


@pytest.mark.parametrize(
    ("name", "steps", "expected"),
    [
        ("first sighting is unknown", [("beat", 0.0, 0, 5)], Status.UNKNOWN),
        ("a newer heartbeat makes it alive", ALIVE_AT_0, Status.ALIVE),
        ("the same heartbeat again is not news", [("beat", 0.0, 0, 5), ("beat", 1.0, 0, 5)], Status.UNKNOWN),
        ("alive within the suspect timeout", [*ALIVE_AT_0, *ticks(0.0, 1.25)], Status.ALIVE),
        ("suspect at 1.5 s without news", [*ALIVE_AT_0, *ticks(0.0, 1.5)], Status.SUSPECT),
        ("still suspect at 2.25 s", [*ALIVE_AT_0, *ticks(0.0, 2.25)], Status.SUSPECT),
        ("dead at 2.5 s", [*ALIVE_AT_0, *ticks(0.0, 2.5)], Status.DEAD),
        (
            "regular heartbeats keep it alive",
            [
                *ALIVE_AT_0,
                *[s for k in range(1, 20) for s in (("beat", k * 0.5, 0, 2 + k), ("tick", k * 0.5))],
            ],
            Status.ALIVE,
        ),
        (
            "a stale heartbeat does not refresh",
            [*ALIVE_AT_0, ("tick", 1.0), ("beat", 1.2, 0, 1), ("tick", 1.5)],
            Status.SUSPECT,
        ),
        (
            "a higher heartbeat clears suspicion",
            [*ALIVE_AT_0, *ticks(0.0, 1.5), ("beat", 1.6, 0, 3)],
            Status.ALIVE,
        ),
        (
            "a higher incarnation refutes suspicion, even with a lower counter",
            [*ALIVE_AT_0, *ticks(0.0, 1.5), ("beat", 1.6, 1, 0)],
            Status.ALIVE,
        ),
        (
            "a lower incarnation is stale, whatever its counter",
            [("beat", 0.0, 2, 1), ("beat", 0.0, 2, 2), *ticks(0.0, 1.5), ("beat", 1.6, 1, 99)],
            Status.SUSPECT,
        ),
        (
            "dead, then back with fresh heartbeats (SIGSTOP, SIGCONT)",
            [*ALIVE_AT_0, *ticks(0.0, 5.0), ("beat", 5.1, 0, 3), ("tick", 5.25)],
            Status.ALIVE,
        ),
        ("a clean leave is immediate", [*ALIVE_AT_0, ("leave", 0.5, 0, 3), ("tick", 0.5)], Status.LEFT),
        (
            "a left node is never suspected",
            [*ALIVE_AT_0, ("leave", 0.5, 0, 3), *ticks(0.5, 9.0)],
            Status.LEFT,
        ),
        ("first sighting of a goodbye", [("leave", 0.0, 0, 7)], Status.LEFT),
        ("a left node that rejoins is alive", [("leave", 0.0, 0, 7), ("beat", 3.0, 0, 8)], Status.ALIVE),
        (
            "a record never heard from is not suspected",
            [("beat", 0.0, 0, 5), *ticks(0.0, 2.25)],
            Status.UNKNOWN,
        ),
        ("a record never heard from ends dead", [("beat", 0.0, 0, 5), *ticks(0.0, 2.5)], Status.DEAD),
        (
            "a local pause (no ticks for 10 s) is not the peers' silence",
            [*ALIVE_AT_0, ("tick", 0.25), ("tick", 10.25), ("tick", 10.5)],
            Status.ALIVE,
        ),
        (
            "connection closed and silent since: dead 1.5 s later, not 2.5",
            [*ALIVE_AT_0, ("beat", 1.0, 0, 3), ("cut", 1.1), *ticks(1.0, 2.75)],
            Status.DEAD,
        ),
        (
            "connection closed: not dead before 1.5 s",
            [*ALIVE_AT_0, ("beat", 1.0, 0, 3), ("cut", 1.1), *ticks(1.0, 2.5)],
            Status.SUSPECT,
        ),
        (
            "connection closed, but newer heartbeats came through the others: alive",
            [*ALIVE_AT_0, ("cut", 0.3), ("beat", 0.5, 0, 3), ("beat", 0.6, 0, 4), *ticks(0.5, 2.0)],
            Status.ALIVE,
        ),
        (
            "one heartbeat arriving after the cut may have been sent before it: still lost",
            [*ALIVE_AT_0, ("cut", 0.3), ("beat", 0.6, 0, 3), *ticks(0.5, 2.0)],
            Status.DEAD,
        ),
        (
            "a new authenticated connection after the cut proves it alive",
            [*ALIVE_AT_0, ("beat", 1.0, 0, 3), ("cut", 1.1), ("reconnect", 1.3), *ticks(1.0, 2.75)],
            Status.SUSPECT,
        ),
        (
            "a new incarnation after the cut proves it alive",
            [*ALIVE_AT_0, ("cut", 0.3), ("beat", 0.6, 1, 0), *ticks(0.5, 2.0)],
            Status.ALIVE,
        ),
        (
            "heartbeats after the cut clear it for good: silence alone judges again",
            [*ALIVE_AT_0, ("cut", 0.3), ("beat", 0.5, 0, 3), ("beat", 0.5, 0, 4), *ticks(0.5, 2.75)],
            Status.SUSPECT,
        ),
        (
            "dead after a cut, then back (SIGCONT): alive from its first new heartbeat, no flapping",
            [*ALIVE_AT_0, ("cut", 0.3), *ticks(0.5, 2.0), ("beat", 5.0, 0, 3), *ticks(5.0, 5.75)],
            Status.ALIVE,
        ),
        (
            "a cut during a local pause is not counted",
            [*ALIVE_AT_0, ("tick", 0.25), ("cut", 0.3), ("tick", 10.25), ("tick", 10.5)],
            Status.ALIVE,
        ),
        (
            "after a pause, silence still counts from the resume",
            [*ALIVE_AT_0, ("tick", 0.25), *ticks(10.25, 12.75)],
            Status.DEAD,
        ),
    ],
)
def test_transitions(name: str, steps: list[Step], expected: Status) -> None:
    view, _ = run(steps)
    assert view.status(N) is expected, name


def test_transition_events_tell_the_ladder() -> None:
    _, log = run([*ALIVE_AT_0, *ticks(0.0, 3.0), ("beat", 3.1, 0, 3)])
    assert [(t.before, t.after, t.at) for t in log] == [
        (None, Status.UNKNOWN, 0.0),
        (Status.UNKNOWN, Status.ALIVE, 0.0),
        (Status.ALIVE, Status.SUSPECT, 1.5),
        (Status.SUSPECT, Status.DEAD, 2.5),
        (Status.DEAD, Status.ALIVE, 3.1),
    ]


def test_the_default_notices_a_vanished_node_within_three_seconds() -> None:
    # Heartbeats every 0.5 s, the peer vanishes right after its beat at t=2.0, ticks every 0.25 s.
    steps: list[Step] = [("beat", 0.0, 0, 0)]
    steps += [s for k in range(1, 5) for s in (("beat", k * 0.5, 0, k), ("tick", k * 0.5))]
    _, log = run(steps + ticks(2.0, 6.0, CFG.tick_interval_s))
    dead_at = next(t.at for t in log if t.after is Status.DEAD)
    assert dead_at - 2.0 < 3.0


def test_config_rejects_inconsistent_timings() -> None:
    with pytest.raises(ValueError):
        FailureDetectorConfig(suspect_after_s=3.0, dead_after_s=2.0)
    with pytest.raises(ValueError):
        FailureDetectorConfig(tick_interval_s=2.0, pause_threshold_s=1.0)
    with pytest.raises(ValueError):
        FailureDetectorConfig(lost_dead_after_s=6.0)


def test_view_lists_live_members_and_suspects() -> None:
    view = View.empty()
    for node, hb in [(NodeId("a"), 1), (NodeId("b"), 1), (NodeId("c"), 1)]:
        view, _ = observe(view, node, 0, hb, 0.0)
        view, _ = observe(view, node, 0, hb + 1, 0.0)
    view, _ = observe(view, NodeId("a"), 0, 3, 1.0)
    view, _ = tick(view, 1.75, CFG)
    view, _ = observe(view, NodeId("c"), 0, 3, 1.75, left=True)
    assert view.status(NodeId("b")) is Status.SUSPECT
    assert view.live() == {"a", "b"}
    assert view.suspects() == (Suspicion(NodeId("b"), 0),)


def test_observe_state_reads_every_heartbeat_but_ones_own() -> None:
    state = ClusterState.empty().with_heartbeat(ME).with_heartbeat(N)
    view, log = observe_state(View.empty(), state, ME, 0.0)
    assert [(t.node, t.after) for t in log] == [(N, Status.UNKNOWN)]
    view, log = observe_state(view, state.with_heartbeat(N), ME, 0.5)
    assert [(t.node, t.after) for t in log] == [(N, Status.ALIVE)]
    view, log = observe_state(view, state.with_heartbeat(N).with_leave(N), ME, 0.75)
    assert view.status(N) is Status.LEFT
    assert ME not in view.members


def test_refutation_round_trip_through_the_state() -> None:
    # N suspects ME; ME hears of it, bumps its incarnation; N's detector takes the new heartbeat.
    view = View.empty()
    me_state = ClusterState.empty().with_heartbeat(ME).with_heartbeat(ME)
    view, _ = observe_state(view, me_state, N, 0.0)
    view, _ = observe_state(view, me_state.with_heartbeat(ME), N, 0.1)
    view, _ = tick(view, 1.6, CFG)
    assert view.suspects() == (Suspicion(ME, 0),)
    n_state = me_state.with_heartbeat(N, view.suspects())
    me_state = me_state.merge(n_state)
    assert me_state.is_suspected(ME)
    me_state = me_state.with_heartbeat(ME)
    view, log = observe_state(view, me_state, N, 1.7)
    assert view.status(ME) is Status.ALIVE
    assert log[-1].incarnation == 1

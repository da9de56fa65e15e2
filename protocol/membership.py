"""The failure detector: who is alive, judged from heartbeats in the cluster state. Pure; `now` passed in.

Each node runs its own detector over the heartbeats it has merged. A member is judged on the LOCAL time
at which a newer heartbeat (incarnation, counter) was last seen, never on a remote clock:

    unknown --newer heartbeat--> alive --suspect_after_s--> suspect --dead_after_s--> dead
                                   ^--------------newer heartbeat----------------------'
    any --left=True (newer)--> left;  unknown --dead_after_s--> dead

A member first seen through the state (not yet heard from since) is `unknown`: a stale record of a
node that died long ago never looks alive, and a live newcomer turns alive with its next heartbeat.

Incarnations: a node that finds itself named in another's `suspects` bumps its incarnation (see
`ClusterState.with_heartbeat`). Any newer heartbeat clears suspicion here, so the bump's role is to
make the refutation immediate and to outdate the suspicion (a record suspecting incarnation i no
longer applies at i + 1). A node restarted with the same identity continues above its old version.

A closed connection is a second, faster signal: a crashed or killed node's sockets close at once
(`disconnected`). A member whose last connection closed and that gives no proof of life within
`lost_dead_after_s` is dead then, without waiting out `dead_after_s`. A live node whose connection
merely dropped reconnects (`reconnected`: a new authenticated connection is proof of life) or keeps
heartbeating through the other members' gossip well within that time. A frozen node (its sockets
stay open) is still judged by silence alone.

A local pause (SIGSTOP, a starved event loop) must not make every peer look dead: when `tick` finds
that more than `pause_threshold_s` passed since the previous tick, the gap is not counted against
anyone. The driver must therefore tick at least every `tick_interval_s`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import StrEnum

from protocol.cluster import ClusterState
from protocol.cluster_records import Suspicion
from protocol.ids import NodeId


@dataclass(frozen=True, slots=True)
class FailureDetectorConfig:
    """Timing of heartbeats and judgements. The defaults notice a killed node (its sockets close)
    within ~2 s and a frozen or cut-off one within ~5.5 s on a LAN.

    Worst case from the moment a node freezes to `dead` here:
    dead_after_s + tick_interval_s + gossip latency = 5.0 + 0.25 + ~0.01 s.
    """

    heartbeat_interval_s: float = 0.5
    """How often a node writes and publishes its heartbeat. Lower: faster detection, more gossip."""
    tick_interval_s: float = 0.25
    """How often the driver calls `tick`: the granularity of every judgement below."""
    suspect_after_s: float = 2.0
    """4 heartbeats missed in a row. Suspicion changes nothing but the gossiped `suspects` hint."""
    dead_after_s: float = 5.0
    """10 heartbeats missed (and ~5 anti-entropy rounds at 1 s). With 2.5 s (5 missed), a node
    starting on a busy 2-core machine (three nodes, runners loading) went silent 2.5-3 s, was
    declared dead, and the leader re-placed its instances; it came back alive 0.2 s later
    (measured in tests/test_cluster_files_nodes.py, 2 runs in 13). A killed node's closed
    connections still make it dead within `lost_dead_after_s`."""
    pause_threshold_s: float = 1.0
    """A gap between ticks longer than this is a local pause, not a silence of the peers."""
    lost_dead_after_s: float = 1.5
    """After its last connection closed, this long without a newer heartbeat makes a member dead:
    3 heartbeats, so a live node that lost one connection is heard through others or redialed."""

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_interval_s < self.suspect_after_s < self.dead_after_s:
            raise ValueError("need 0 < heartbeat_interval_s < suspect_after_s < dead_after_s")
        if not self.heartbeat_interval_s < self.lost_dead_after_s <= self.dead_after_s:
            raise ValueError("need heartbeat_interval_s < lost_dead_after_s <= dead_after_s")
        if not 0 < self.tick_interval_s < self.pause_threshold_s:
            raise ValueError("need 0 < tick_interval_s < pause_threshold_s")


class Status(StrEnum):
    UNKNOWN = "unknown"
    ALIVE = "alive"
    SUSPECT = "suspect"
    DEAD = "dead"
    LEFT = "left"


LIVE = frozenset({Status.ALIVE, Status.SUSPECT})
"""Statuses that count as a member for the election: suspicion alone does not move the leader."""


@dataclass(frozen=True, slots=True)
class MemberState:
    node: NodeId
    status: Status
    incarnation: int
    heartbeat: int
    last_advance: float
    """Local time at which this heartbeat (or the first sighting) arrived."""
    lost_at: float | None = None
    """Local time at which its last connection closed, unless it proved alive since."""
    lost_beat: int = 0
    """The heartbeat counter known when the connection closed (see `_still_lost`)."""


@dataclass(frozen=True, slots=True)
class Transition:
    node: NodeId
    before: Status | None
    after: Status
    incarnation: int
    at: float


@dataclass(frozen=True, slots=True)
class View:
    """One node's judgement of its peers (itself excluded). Immutable: `observe` and `tick` return new."""

    members: Mapping[NodeId, MemberState]
    last_tick: float | None = None

    @classmethod
    def empty(cls) -> View:
        return cls({})

    def status(self, node: NodeId) -> Status | None:
        member = self.members.get(node)
        return member.status if member is not None else None

    def live(self) -> frozenset[NodeId]:
        """Peers alive or suspected: the membership the election runs on (add yourself)."""
        return frozenset(node for node, m in self.members.items() if m.status in LIVE)

    def alive(self) -> frozenset[NodeId]:
        """Peers alive, not merely suspected: who can send files or take a placement now."""
        return frozenset(node for node, m in self.members.items() if m.status is Status.ALIVE)

    def suspects(self) -> tuple[Suspicion, ...]:
        """Peers suspected now, to publish in this node's next heartbeat."""
        return tuple(
            sorted(
                Suspicion(node, m.incarnation)
                for node, m in self.members.items()
                if m.status is Status.SUSPECT
            )
        )


def _observe(
    known: MemberState | None, node: NodeId, incarnation: int, heartbeat: int, now: float, left: bool
) -> tuple[MemberState | None, Transition | None]:
    """The ladder for one heartbeat: (new member state or None if unchanged, transition or None)."""
    # First sighting: a record is not proof of life; wait for it to advance (or for a goodbye).
    if known is None:
        status = Status.LEFT if left else Status.UNKNOWN
        member = MemberState(node, status, incarnation, heartbeat, now)
        return member, Transition(node, None, status, incarnation, now)
    # Not newer (a duplicate, or an older copy arriving late): nothing learned.
    if (incarnation, heartbeat) <= (known.incarnation, known.heartbeat):
        return None, None
    # Newer with a goodbye: left, final until a newer heartbeat says otherwise.
    # Newer and alive: refutes suspicion (any incarnation), revives the dead (SIGCONT), the left
    # (rejoined) and the unknown (a newcomer).
    after = Status.LEFT if left else Status.ALIVE
    member = MemberState(node, after, incarnation, heartbeat, now)
    if _still_lost(known, incarnation, heartbeat):
        member = replace(member, lost_at=known.lost_at, lost_beat=known.lost_beat)
    if known.status is after:
        return member, None
    return member, Transition(node, known.status, after, incarnation, now)


def observe(
    view: View, node: NodeId, incarnation: int, heartbeat: int, now: float, *, left: bool = False
) -> tuple[View, list[Transition]]:
    """Takes in `node`'s latest heartbeat as merged into the state. Returns the new view and changes."""
    member, change = _observe(view.members.get(node), node, incarnation, heartbeat, now, left)
    if member is None:
        return view, []
    members = dict(view.members)
    members[node] = member
    return View(members, view.last_tick), [change] if change is not None else []


def observe_state(
    view: View, state: ClusterState, self_id: NodeId, now: float
) -> tuple[View, list[Transition]]:
    """`observe` for every heartbeat in `state` except this node's own. Call after each merge."""
    members: dict[NodeId, MemberState] | None = None
    changes: list[Transition] = []
    for node, beat in state.heartbeats().items():
        if node == self_id:
            continue
        current = members if members is not None else view.members
        member, change = _observe(current.get(node), node, beat.incarnation, beat.counter, now, beat.left)
        if member is None:
            continue
        if members is None:
            members = dict(view.members)
        members[node] = member
        if change is not None:
            changes.append(change)
    return (view if members is None else View(members, view.last_tick)), changes


def _still_lost(known: MemberState, incarnation: int, heartbeat: int) -> bool:
    """Whether a newer heartbeat leaves a lost connection unexplained. The one heartbeat a node may
    have sent just before it died can arrive after its connection closed (relayed by others); only
    a second one, or a new incarnation, proves it alive."""
    return known.lost_at is not None and incarnation == known.incarnation and heartbeat < known.lost_beat + 2


def disconnected(view: View, node: NodeId, now: float) -> View:
    """Notes that `node`'s last connection closed at `now` (until it proves alive)."""
    member = view.members.get(node)
    if member is None or member.status in (Status.LEFT, Status.DEAD) or member.lost_at is not None:
        return view
    lost = replace(member, lost_at=now, lost_beat=member.heartbeat)
    return View({**view.members, node: lost}, view.last_tick)


def reconnected(view: View, node: NodeId) -> View:
    """`node` authenticated a connection with us again: alive, whatever the closed one suggested."""
    member = view.members.get(node)
    if member is None or member.lost_at is None:
        return view
    return View({**view.members, node: replace(member, lost_at=None)}, view.last_tick)


def _judge(member: MemberState, now: float, config: FailureDetectorConfig) -> Status:
    # Left and dead stay so until a newer heartbeat arrives (handled by `observe`).
    if member.status in (Status.LEFT, Status.DEAD):
        return member.status
    # Silent too long, or cut off and silent since: dead, whatever it was.
    if now - member.last_advance >= config.dead_after_s:
        return Status.DEAD
    if member.lost_at is not None and now - member.lost_at >= config.lost_dead_after_s:
        return Status.DEAD
    silence = now - member.last_advance
    # An unknown member is never suspected: it has not been alive yet.
    if member.status is Status.UNKNOWN:
        return Status.UNKNOWN
    # Silent a while: suspect.
    if silence >= config.suspect_after_s:
        return Status.SUSPECT
    return member.status


def _shifted(member: MemberState, gap: float, now: float) -> MemberState:
    """Moves a member's clocks forward by a local pause of `gap` seconds (never past `now`)."""
    lost_at = None if member.lost_at is None else min(member.lost_at + gap, now)
    return replace(member, last_advance=min(member.last_advance + gap, now), lost_at=lost_at)


def tick(view: View, now: float, config: FailureDetectorConfig) -> tuple[View, list[Transition]]:
    """Judges every member at local time `now`. Call every `config.tick_interval_s`."""
    members = dict(view.members)
    # A long gap since the last tick means this process was paused: shift every clock by the gap.
    if view.last_tick is not None and now - view.last_tick > config.pause_threshold_s:
        gap = now - view.last_tick
        members = {n: _shifted(m, gap, now) for n, m in members.items()}
    changes: list[Transition] = []
    for node, member in members.items():
        after = _judge(member, now, config)
        if after is not member.status:
            changes.append(Transition(node, member.status, after, member.incarnation, now))
            # Dead is final until a newer heartbeat: the cut that led here is no longer evidence.
            lost_at = None if after is Status.DEAD else member.lost_at
            members[node] = replace(member, status=after, lost_at=lost_at)
    return View(members, now), changes

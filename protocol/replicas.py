"""Which replica of a model takes a request: the least loaded ready one, this node's own on ties.

A model may run as several instances (replicas) on disjoint sets of nodes. Each node reports, in
its `NodeLoad` record, the instances it is the entry of (their first stage runs there): whether
the runner takes requests and how many are in it. A report is up to a heartbeat old, so the node
that chooses also counts the requests it has open to each entry itself (`dispatched`), which it
knows at once: a burst through one node spreads over the replicas instead of following one stale
figure. An entry's load is the larger of the two (the report already holds this node's requests
once it catches up, so adding them would count them twice).

`order_replicas` ranks, best first ("alive": the caller's live set, alive or only suspected, since
suspicion is a hint and not a verdict):
1. ready replicas whose entry node is alive: least load first, then this node's own (no hop),
   then the one this node sent fewer requests to so far (equal loads take turns, so requests one
   after another spread too), then by instance id;
2. replicas on alive nodes that are not ready (loading, restarting, not reported yet): this
   node's own first, then by id; a request sent there waits or hears that the model is loading;
3. replicas whose entry node is not alive (dead, gone), by id: the last resort, until the
   leader's repair re-places them.
Pure: records, reports and counts in, an order out.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

from protocol.cluster_records import EntryLoad, InstanceRecord, NodeLoad
from protocol.cluster_view import LoadView
from protocol.ids import InstanceId, NodeId


@dataclass(frozen=True, slots=True)
class Replica:
    """One instance of a model as the choosing node sees it."""

    instance_id: InstanceId
    entry: NodeId
    ready: bool
    load: int
    """Requests running or waiting at its entry (see the module doc)."""
    alive: bool
    sent: int = 0
    """Requests this node sent to its entry so far (the tie-break after locality)."""


def order_replicas(replicas: Iterable[Replica], me: NodeId) -> list[Replica]:
    """The replicas best first (the module doc's order); deterministic whatever the input order."""

    def rank(replica: Replica) -> tuple[int, int, bool, int, str]:
        tier = 0 if replica.alive and replica.ready else 1 if replica.alive else 2
        busy = (replica.load, replica.sent) if tier == 0 else (0, 0)
        return (tier, busy[0], tier == 2 or replica.entry != me, busy[1], replica.instance_id)

    return sorted(replicas, key=rank)


def entry_load(load: NodeLoad | None, instance_id: InstanceId) -> EntryLoad | None:
    """What `load` (a node's report) says of `instance_id`; None when it says nothing."""
    if load is None:
        return None
    return next((e for e in load.entries if e.instance_id == instance_id), None)


def replicas_of(
    model: str,
    records: Iterable[InstanceRecord],
    loads: Mapping[NodeId, NodeLoad],
    alive: Collection[NodeId],
    me: NodeId,
    dispatched: Mapping[NodeId, int],
    sent: Mapping[NodeId, int] | None = None,
) -> list[Replica]:
    """The instances of `model` in `records`, with what their entries reported (`loads`: this
    node's own entry as it is now, not as last gossiped), the requests this node has open to each
    entry node (`dispatched`) and has sent to each so far (`sent`). `me` counts as alive."""
    found: list[Replica] = []
    for record in records:
        if record.model != model:
            continue
        entry = record.stages[0].node
        reported = entry_load(loads.get(entry), record.instance_id)
        active = reported.active if reported is not None else 0
        found.append(
            Replica(
                record.instance_id,
                entry,
                ready=reported is not None and reported.runner == "ready",
                load=max(active, dispatched.get(entry, 0)),
                alive=entry == me or entry in alive,
                sent=(sent or {}).get(entry, 0),
            )
        )
    return found


def load_view(record: InstanceRecord, loads: Mapping[NodeId, NodeLoad]) -> LoadView | None:
    """What `/v1/cluster` shows of `record`'s load: its entry node's report, None before one."""
    reported = entry_load(loads.get(record.stages[0].node), record.instance_id)
    if reported is None:
        return None
    return LoadView(
        ready=reported.runner == "ready",
        runner=reported.runner,
        error=reported.error or None,
        active=reported.active,
        queued=reported.queued,
        served=reported.served,
    )

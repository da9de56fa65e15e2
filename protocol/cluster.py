"""The cluster state: a state-based CRDT of owned records, merged by version. Pure: no I/O, no clock.

Data model (records in `protocol.cluster_records`):
- Each node owns its `NodeProfile`, its `Liveness`, its `NodeHoldings`, its `NodeTransfers` and its
  `NodeLoad`, keyed by its node id, versioned (incarnation, counter). The counter is one per node,
  shared by its records, and every write bumps it: the `Liveness` version is the node's heartbeat.
- The leader owns the `LeaderClaim` (one key) and the `InstanceRecord`s (one key per instance),
  versioned (term, counter). A higher term beats any lower one, key by key; a new leader inherits
  every instance record until it rewrites or deletes it (no wipe on a term change).
- A delete is a tombstone: an entry whose value is None, versioned like any write.

Merge keeps, per key, the entry with the greatest stamp (version, then a hash of owner and value as a
deterministic tie-break). A per-key maximum of a total order is commutative, associative and
idempotent, so replicas that have seen the same entries are equal whatever the order, duplication or
loss along the way. A delta is itself a `ClusterState`; anti-entropy sends `missing_for(digest)`.

Trust: nothing here proves who wrote an entry (no signatures). Any node admitted to the cluster can
write any record; admission is the transport's job (a cluster secret at connection time). The rules
here (`check_entry`, enforced by the codec) only keep an honest cluster consistent: a profile is
owned by the node it describes, a claim by the node it names.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TypeVar

from protocol.cluster_records import (
    LEADER_KEY_ID,
    NODE_KINDS,
    Entry,
    InstanceRecord,
    LeaderClaim,
    Liveness,
    NodeHoldings,
    NodeLoad,
    NodeProfile,
    NodeTransfers,
    RecordKey,
    RecordKind,
    RecordValue,
    Stamp,
    Suspicion,
    Version,
    check_entry,
)
from protocol.ids import InstanceId, NodeId
from protocol.record_limits import MAX_SUSPECTS

_LEADER_KEY: RecordKey = (RecordKind.LEADER, LEADER_KEY_ID)
_Owned = TypeVar("_Owned", NodeHoldings, NodeTransfers, NodeLoad)


class NotLeaderError(RuntimeError):
    """A local bug: a leader-owned write from a node that does not hold the current claim."""


@dataclass(frozen=True, slots=True)
class Digest:
    """What a replica holds, compactly: key -> stamp. Send it; the peer answers with what you lack."""

    stamps: Mapping[RecordKey, Stamp]

    def __len__(self) -> int:
        return len(self.stamps)


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """A node's latest liveness record, as the failure detector reads it."""

    node: NodeId
    incarnation: int
    counter: int
    left: bool
    suspects: tuple[Suspicion, ...]


class ClusterState:
    """An immutable set of entries, at most one per key. Every method returns a new state (or self)."""

    __slots__ = ("_digest", "_entries")

    def __init__(self, entries: Mapping[RecordKey, Entry]) -> None:
        """Wraps `entries` without copying: the caller hands them over and never mutates them again."""
        self._entries = entries
        self._digest: Digest | None = None

    @classmethod
    def empty(cls) -> ClusterState:
        return cls({})

    @classmethod
    def of(cls, entries: Iterable[tuple[RecordKey, Entry]]) -> ClusterState:
        """A state from (key, entry) pairs; for one key, the greatest stamp wins. Checks each entry."""
        table: dict[RecordKey, Entry] = {}
        for key, entry in entries:
            check_entry(key, entry)
            mine = table.get(key)
            if mine is None or entry.stamp > mine.stamp:
                table[key] = entry
        return cls(table)

    # Generic CRDT operations.
    @property
    def entries(self) -> Mapping[RecordKey, Entry]:
        return self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[tuple[RecordKey, Entry]]:
        return iter(self._entries.items())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ClusterState):
            return NotImplemented
        return self.digest() == other.digest()

    def __hash__(self) -> int:
        return hash(frozenset(self.digest().stamps.items()))

    def __repr__(self) -> str:
        return f"ClusterState({len(self._entries)} entries)"

    def merge(self, other: ClusterState) -> ClusterState:
        """The per-key maximum of both states; returns self when `other` brings nothing new."""
        changed: dict[RecordKey, Entry] | None = None
        for key, theirs in other._entries.items():
            mine = self._entries.get(key)
            if mine is None or theirs.stamp > mine.stamp:
                if changed is None:
                    changed = dict(self._entries)
                changed[key] = theirs
        return self if changed is None else ClusterState(changed)

    def digest(self) -> Digest:
        if self._digest is None:
            self._digest = Digest({key: entry.stamp for key, entry in self._entries.items()})
        return self._digest

    def missing_for(self, digest: Digest, limit: int | None = None) -> ClusterState:
        """The delta a replica with `digest` lacks: entries it has not got, or holds an older stamp of.

        With `limit`, at most that many entries (the rest follow in the next exchange).
        """
        out: dict[RecordKey, Entry] = {}
        theirs = digest.stamps
        for key, entry in self._entries.items():
            stamp = theirs.get(key)
            if stamp is None or entry.stamp > stamp:
                out[key] = entry
                if limit is not None and len(out) >= limit:
                    break
        return ClusterState(out)

    def delta_since(self, before: ClusterState) -> ClusterState:
        """The entries that differ from `before` (an older copy of this replica): what to gossip now."""
        old = before._entries
        return ClusterState({key: entry for key, entry in self._entries.items() if old.get(key) is not entry})

    # Node-owned writes: call them only for your own node id.
    def node_version(self, node: NodeId) -> Version:
        """The highest version among `node`'s own records here, (0, 0) if none."""
        best: Version = (0, 0)
        for kind in NODE_KINDS:
            entry = self._entries.get((kind, node))
            if entry is not None and entry.version > best:
                best = entry.version
        return best

    def _write(
        self, key: RecordKey, owner: NodeId, version: Version, value: RecordValue | None
    ) -> ClusterState:
        entry = Entry(owner, version, value)
        check_entry(key, entry)
        return self.merge(ClusterState({key: entry}))

    def with_profile(self, node: NodeId, profile: NodeProfile) -> ClusterState:
        """Writes `node`'s profile if it differs from the one here; a no-op otherwise.

        Call it on every heartbeat: after a restart it also replaces the previous life's profile (its
        `started_at` differs), once merging has taught this node the old version.
        """
        return self._with_own(RecordKind.PROFILE, node, profile)

    def with_holdings(self, node: NodeId, holdings: NodeHoldings) -> ClusterState:
        """Writes the models `node` serves to its peers if they changed, like `with_profile`."""
        return self._with_own(RecordKind.HOLDINGS, node, holdings)

    def with_transfers(self, node: NodeId, transfers: NodeTransfers) -> ClusterState:
        """Writes the model files moving to `node` if they changed, like `with_profile`."""
        return self._with_own(RecordKind.TRANSFERS, node, transfers)

    def with_load(self, node: NodeId, load: NodeLoad) -> ClusterState:
        """Writes the load of the instances `node` is the entry of if it changed, like `with_profile`."""
        return self._with_own(RecordKind.LOAD, node, load)

    def _with_own(self, kind: RecordKind, node: NodeId, value: RecordValue) -> ClusterState:
        current = self._entries.get((kind, node))
        if current is not None and current.value == value:
            return self
        incarnation, counter = self.node_version(node)
        return self._write((kind, node), node, (incarnation, counter + 1), value)

    def with_heartbeat(self, node: NodeId, suspects: Iterable[Suspicion] = ()) -> ClusterState:
        """Writes `node`'s next heartbeat, naming who it suspects now (at most `MAX_SUSPECTS`).

        If any other node's latest liveness record suspects `node` at its current incarnation, the
        incarnation goes up by one: that refutes the suspicion everywhere at once. Calling this right
        after a merge that made `is_suspected(node)` true is how a node answers fast.
        """
        incarnation, counter = self.node_version(node)
        suspected_at = self._suspected_at(node)
        if suspected_at is not None:
            incarnation = suspected_at + 1
        listed = tuple(sorted(set(suspects)))[:MAX_SUSPECTS]
        return self._write(
            (RecordKind.LIVENESS, node), node, (incarnation, counter + 1), Liveness(False, listed)
        )

    def with_leave(self, node: NodeId) -> ClusterState:
        """`node` says goodbye: observers mark it left at once, without suspecting it first."""
        incarnation, counter = self.node_version(node)
        return self._write((RecordKind.LIVENESS, node), node, (incarnation, counter + 1), Liveness(True))

    # Leader-owned writes.
    def with_leader_claim(self, node: NodeId, term: int) -> ClusterState:
        """`node` claims leadership for `term` (see `protocol.election`); a lower term loses the merge."""
        return self._write(_LEADER_KEY, node, (term, 0), LeaderClaim(node, term))

    def _leader_version(self, leader: NodeId, term: int) -> Version:
        claim = self.leader_claim()
        if claim is None or claim != LeaderClaim(leader, term):
            raise NotLeaderError(f"{leader} does not hold term {term} (claim here: {claim})")
        counter = 0
        for (kind, _), entry in self._entries.items():
            if kind is RecordKind.INSTANCE and entry.version[0] == term:
                counter = max(counter, entry.version[1])
        return (term, counter + 1)

    def with_instance(self, leader: NodeId, term: int, record: InstanceRecord) -> ClusterState:
        """The leader of `term` creates or replaces an instance. Raises NotLeaderError otherwise."""
        version = self._leader_version(leader, term)
        return self._write((RecordKind.INSTANCE, record.instance_id), leader, version, record)

    def without_instance(self, leader: NodeId, term: int, instance_id: InstanceId) -> ClusterState:
        """The leader of `term` deletes an instance by writing a tombstone (kept: deletes must merge)."""
        version = self._leader_version(leader, term)
        return self._write((RecordKind.INSTANCE, instance_id), leader, version, None)

    # Readers.
    def members(self) -> tuple[NodeId, ...]:
        """Every node with a record here, alive or not, sorted."""
        return tuple(sorted({NodeId(key_id) for kind, key_id in self._entries if kind in NODE_KINDS}))

    def profiles(self) -> dict[NodeId, NodeProfile]:
        return {
            NodeId(key_id): entry.value
            for (kind, key_id), entry in self._entries.items()
            if kind is RecordKind.PROFILE and isinstance(entry.value, NodeProfile)
        }

    def holdings(self) -> dict[NodeId, NodeHoldings]:
        return self._owned(RecordKind.HOLDINGS, NodeHoldings)

    def transfers(self) -> dict[NodeId, NodeTransfers]:
        return self._owned(RecordKind.TRANSFERS, NodeTransfers)

    def loads(self) -> dict[NodeId, NodeLoad]:
        return self._owned(RecordKind.LOAD, NodeLoad)

    def _owned(self, kind: RecordKind, cls: type[_Owned]) -> dict[NodeId, _Owned]:
        return {
            NodeId(key_id): entry.value
            for (k, key_id), entry in self._entries.items()
            if k is kind and isinstance(entry.value, cls)
        }

    def heartbeats(self) -> dict[NodeId, Heartbeat]:
        out: dict[NodeId, Heartbeat] = {}
        for (kind, key_id), entry in self._entries.items():
            if kind is RecordKind.LIVENESS and isinstance(entry.value, Liveness):
                node = NodeId(key_id)
                incarnation, counter = entry.version
                out[node] = Heartbeat(node, incarnation, counter, entry.value.left, entry.value.suspects)
        return out

    def is_suspected(self, node: NodeId) -> bool:
        """Whether another node's latest liveness record suspects `node` at its current incarnation."""
        return self._suspected_at(node) is not None

    def _suspected_at(self, node: NodeId) -> int | None:
        # The highest incarnation of `node` that a live record suspects, if not below the current one.
        incarnation = self.node_version(node)[0]
        found: int | None = None
        for (kind, key_id), entry in self._entries.items():
            value = entry.value
            if kind is not RecordKind.LIVENESS or key_id == node or not isinstance(value, Liveness):
                continue
            if value.left:
                continue
            for suspicion in value.suspects:
                if suspicion.node == node and suspicion.incarnation >= incarnation:
                    found = max(found or 0, suspicion.incarnation)
        return found

    def leader_claim(self) -> LeaderClaim | None:
        entry = self._entries.get(_LEADER_KEY)
        return entry.value if entry is not None and isinstance(entry.value, LeaderClaim) else None

    def instances(self) -> dict[InstanceId, InstanceRecord]:
        """Live instances (tombstones left out), by id."""
        return {
            InstanceId(key_id): entry.value
            for (kind, key_id), entry in self._entries.items()
            if kind is RecordKind.INSTANCE and isinstance(entry.value, InstanceRecord)
        }

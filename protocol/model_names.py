"""One model name everywhere: which names the cluster uses, who holds the model a name stands for,
and the name a newly offered model gets. Pure: records in, decisions out.

A model is shown (in `/v1/models`, `/v1/cluster`, `/v1/cluster/models`, `/api/tags`, the dashboard)
by the name its instance records and its holders' `Holding.model` carry: a folder's name, a .gguf's
stem, a repo id, `smollm2-135m`. Any node accepts that name: it finds a node that holds the model
under it and asks that node to describe it (manifest and shape), then places it as if it had the
files itself; the nodes placed fetch them from the holders.

Two different models (different manifests) with the same folder name get distinct names: the first
the cluster hears of keeps the plain name, each later one is `<name>-<first 8 hex of its manifest
id>` (`distinct_name`), so both can be listed, placed and asked for side by side. The holder
decides when it first offers the model, from what it has heard of the cluster by then.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

from protocol.cluster_records import InstanceRecord, NodeHoldings
from protocol.ids import NodeId

SUFFIX_HEX = 8
"""Hex digits of the manifest id a clashing name gets: 4 billion models before two collide."""


def names_in_use(
    holdings: Mapping[NodeId, NodeHoldings], records: Iterable[InstanceRecord]
) -> dict[str, set[str]]:
    """Every model name the cluster shows, and the manifest ids it stands for (usually one)."""
    used: dict[str, set[str]] = {}
    for record in records:
        if record.manifest is not None:
            used.setdefault(record.model, set()).add(record.manifest.id)
    for node_holdings in holdings.values():
        for holding in node_holdings.models:
            if holding.model:
                used.setdefault(holding.model, set()).add(holding.manifest_id)
    return used


def distinct_name(name: str, manifest_id: str, used: Mapping[str, Collection[str]]) -> str:
    """`name` when no other model goes by it, else `name-<manifest id prefix>` (see the module)."""
    others = set(used.get(name, ())) - {manifest_id}
    return f"{name}-{manifest_id[:SUFFIX_HEX]}" if others else name


def holders_named(
    name: str, holdings: Mapping[NodeId, NodeHoldings], live: Collection[NodeId], me: NodeId
) -> list[NodeId]:
    """The live peers (never `me`) holding every file of a model they call `name`, by node id:
    whom to ask to describe it."""
    return [
        node
        for node in sorted(holdings)
        if name
        and node != me
        and node in live
        and any(h.model == name and h.files is None for h in holdings[node].models)
    ]

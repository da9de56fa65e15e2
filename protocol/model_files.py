"""Which nodes hold a model's files, and what follows from it: whom to fetch from, where to place,
how an instance whose files are moving is doing. Pure: records in, decisions out.

A node advertises the models it serves in its `NodeHoldings` record: a manifest id, and the indices
of the files it has when it has only some (a stage that fetched only its shards). Indices mean
something only with the manifest, which every node learns from the instance record naming it; an
index past the manifest's files is ignored (a hostile or confused peer), never an error.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from protocol.cluster_records import Holding, InstanceRecord, NodeHoldings, NodeTransfers
from protocol.cluster_view import HoldingView, InstanceState, InstanceView, StageView
from protocol.ids import NodeId
from protocol.manifest import Manifest

FILES_PREFIX = "/v1/files"
"""Where a node serves model files to the other members (`api.files`' route)."""


def file_url_path(manifest_id: str, path: str) -> str:
    """The URL path (not percent-encoded) of one model file: what a fetcher asks for and signs
    (`node.files.download`), and what the serving node checks the signature against."""
    return f"{FILES_PREFIX}/{manifest_id}/{path}"


def holding_of(manifest: Manifest, paths: Collection[str], model: str = "") -> Holding | None:
    """What a node serving `paths` of `manifest` (which it calls `model`) advertises: every file
    (indices left out), some (their indices), or nothing (None)."""
    indices = tuple(i for i, entry in enumerate(manifest.files) if entry.path in paths)
    if not indices:
        return None
    return Holding(manifest.id, None if len(indices) == len(manifest.files) else indices, model)


def held_paths(manifest: Manifest, holding: Holding) -> frozenset[str] | None:
    """The paths of `manifest` that `holding` says are there; None: all of them."""
    if holding.files is None:
        return None
    files = manifest.files
    return frozenset(files[i].path for i in holding.files if i < len(files))


def _holding(holdings: NodeHoldings, manifest_id: str) -> Holding | None:
    return next((h for h in holdings.models if h.manifest_id == manifest_id), None)


@dataclass(frozen=True)
class Holder:
    """A peer to fetch from: its node id, the base URL of its HTTP API, and what it holds."""

    node: NodeId
    url: str
    paths: frozenset[str] | None
    """None: every file of the manifest."""


def file_holders(
    manifest: Manifest,
    holdings: Mapping[NodeId, NodeHoldings],
    urls: Mapping[NodeId, str],
    live: Collection[NodeId],
    me: NodeId,
) -> list[Holder]:
    """The live peers (never `me`) that serve some of `manifest`'s files and have an HTTP URL, by
    node id: who a node that lacks the files asks for them."""
    found: list[Holder] = []
    for node in sorted(holdings):
        url = urls.get(node, "")
        if node == me or node not in live or not url.startswith(("http://", "https://")):
            continue
        holding = _holding(holdings[node], manifest.id)
        if holding is None:
            continue
        paths = held_paths(manifest, holding)
        if paths is None or paths:
            found.append(Holder(node, url, paths))
    return found


def held_bytes(manifest: Manifest, holdings: Mapping[NodeId, NodeHoldings]) -> dict[NodeId, int]:
    """Bytes of `manifest` each node serves (nodes serving none left out): placement's preference."""
    held: dict[NodeId, int] = {}
    for node, record in holdings.items():
        holding = _holding(record, manifest.id)
        if holding is None:
            continue
        paths = held_paths(manifest, holding)
        total = sum(e.size for e in manifest.files if paths is None or e.path in paths)
        if total:
            held[node] = total
    return held


def holding_views(holdings: NodeHoldings) -> tuple[HoldingView, ...]:
    """What `/v1/cluster` shows of a member's holdings: each model, and how many of its files."""
    return tuple(
        HoldingView(manifest_id=h.manifest_id, files=None if h.files is None else len(h.files), model=h.model)
        for h in holdings.models
    )


def instance_files_state(
    record: InstanceRecord, transfers: Mapping[NodeId, NodeTransfers]
) -> tuple[InstanceState | None, str | None]:
    """("loading", None) while a stage node's files of the instance are moving, ("failed", why)
    when a stage node's latest transfer of them failed (it is retried after a backoff), else
    (None, None): the files say nothing, the runners do."""
    if record.manifest is None:
        return None, None
    loading = False
    for stage in record.stages:
        moves = transfers.get(stage.node, NodeTransfers()).transfers
        latest = next((t for t in reversed(moves) if t.manifest_id == record.manifest.id), None)
        if latest is None:
            continue
        if latest.state == "failed":
            return "failed", f"node {stage.node[-8:]}: {latest.error or 'the transfer failed'}"
        loading = loading or latest.state == "fetching"
    return ("loading", None) if loading else (None, None)


def holders_gone(
    manifest: Manifest, holdings: Mapping[NodeId, NodeHoldings], live: Collection[NodeId]
) -> bool:
    """Whether nodes were heard of holding files of `manifest` and none of them is in `live` (the
    live nodes but the asking one): the holder died, and waiting for one is pointless. With no holder
    heard of at all, the holdings may not have arrived yet (a record can outrun them by a heartbeat)."""
    known = heard_holders(manifest, holdings)
    return bool(known) and not known & set(live)


def heard_holders(manifest: Manifest, holdings: Mapping[NodeId, NodeHoldings]) -> set[NodeId]:
    """The nodes whose holdings name `manifest`, live or not (a dead node's records stay)."""
    return {node for node, record in holdings.items() if _holding(record, manifest.id) is not None}


def files_unobtainable(
    record: InstanceRecord,
    holdings: Mapping[NodeId, NodeHoldings],
    transfers: Mapping[NodeId, NodeTransfers],
    live: Collection[NodeId],
) -> str | None:
    """Why no node can get `record`'s files now, or None. Unobtainable: a stage node's latest try
    failed (it looks at its own copies first, and for holders), the record has no hub repo to fall
    back on, and the `live` nodes together do not hold every file (so no retry can succeed until a
    holder comes back). A failed try while a live node holds it all is a transfer to retry, not this."""
    manifest = record.manifest
    if manifest is None or record.hub_repo:
        return None
    state, why = instance_files_state(record, transfers)
    if state != "failed":
        return None
    held: set[str] = set()
    for node in live:
        holding = _holding(holdings.get(node, NodeHoldings()), manifest.id)
        paths = held_paths(manifest, holding) if holding is not None else frozenset()
        if paths is None:
            return None
        held |= paths
    return None if held >= {f.path for f in manifest.files} else why


def instance_view(
    record: InstanceRecord, transfers: Mapping[NodeId, NodeTransfers] | None = None
) -> InstanceView:
    """The cluster view of `record`; with the nodes' transfers, how its files are doing."""
    stages = tuple(
        StageView(node_id=s.node, start_layer=s.start_layer, end_layer=s.end_layer) for s in record.stages
    )
    state, error = instance_files_state(record, transfers or {})
    return InstanceView(
        id=record.instance_id,
        model=record.model,
        stages=stages,
        sharding=record.sharding,
        manifest_id=record.manifest.id if record.manifest is not None else None,
        state=state,
        error=error,
    )

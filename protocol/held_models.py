"""What `GET /v1/cluster/models` answers and `shoal models` shows: the model files each node holds.

Built by the answering node from what it knows, pure: every node's `NodeHoldings` record (manifest
ids, the holder's name for each and, for a partial copy, file indices), the manifests it knows
(those the instance records carry, and those it serves itself, with their names), and the nodes'
transfers. A holding whose manifest the answering node has never seen is shown by its id, name and
file count alone: its sizes are then None (and its name too, from a node that sends none).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from pydantic import BaseModel, ConfigDict

from protocol.cluster_records import Holding, InstanceRecord, NodeHoldings, NodeTransfers
from protocol.cluster_view import MemberStatus, MemberView
from protocol.ids import NodeId
from protocol.manifest import Manifest
from protocol.model_files import held_paths


class _View(BaseModel):
    model_config = ConfigDict(frozen=True)


class HeldModelView(_View):
    manifest_id: str
    model: str | None
    """What the user calls it; None when no node told the answering node a name for it."""
    files_held: int | None
    """None: all of the manifest's files (however many the answering node knows there are)."""
    files_total: int | None
    bytes_held: int | None
    bytes_total: int | None
    """Both None when the answering node does not know the manifest."""
    in_use: tuple[str, ...] = ()
    """The instances that run a stage of this model on this node."""


class NodeModelsView(_View):
    node: str
    host: str
    status: MemberStatus
    models: tuple[HeldModelView, ...]


class ClusterModelsView(_View):
    self: str
    """The answering node."""
    nodes: tuple[NodeModelsView, ...]


def _names(
    records: Sequence[InstanceRecord],
    known: Mapping[str, tuple[str, Manifest]],
    transfers: Mapping[NodeId, NodeTransfers],
    holdings: Mapping[NodeId, NodeHoldings],
) -> tuple[dict[str, Manifest], dict[str, str]]:
    """manifest id -> manifest, and -> model name, from every source; instance records first."""
    manifests = {mid: manifest for mid, (_name, manifest) in known.items()}
    names = {h.manifest_id: h.model for record in holdings.values() for h in record.models if h.model}
    names |= {t.manifest_id: t.model for record in transfers.values() for t in record.transfers if t.model}
    names |= {mid: name for mid, (name, _manifest) in known.items()}
    for record in records:
        if record.manifest is not None:
            manifests[record.manifest.id] = record.manifest
            names[record.manifest.id] = record.model
    return manifests, names


def _held(
    holding: Holding, manifest: Manifest | None, name: str | None, used: tuple[str, ...]
) -> HeldModelView:
    if manifest is None:  # a manifest this node never saw: only the count of files it names
        count = None if holding.files is None else len(holding.files)
        files_held, files_total, bytes_held, bytes_total = count, None, None, None
    else:
        paths = held_paths(manifest, holding)
        held = [f for f in manifest.files if paths is None or f.path in paths]
        files_held, files_total = len(held), len(manifest.files)
        bytes_held, bytes_total = sum(f.size for f in held), manifest.total_bytes
    return HeldModelView(
        manifest_id=holding.manifest_id,
        model=name,
        files_held=files_held,
        files_total=files_total,
        bytes_held=bytes_held,
        bytes_total=bytes_total,
        in_use=used,
    )


def node_models(
    members: Iterable[MemberView],
    holdings: Mapping[NodeId, NodeHoldings],
    records: Iterable[InstanceRecord],
    known: Mapping[str, tuple[str, Manifest]],
    transfers: Mapping[NodeId, NodeTransfers],
) -> tuple[NodeModelsView, ...]:
    """Per member (in the order given), each model whose files it serves: name, manifest id, files
    and bytes held of the total, and the instances using it there."""
    instances = list(records)
    manifests, names = _names(instances, known, transfers, holdings)
    users: dict[tuple[str, str], set[str]] = {}
    for record in instances:
        if record.manifest is None:
            continue
        for stage in record.stages:
            users.setdefault((stage.node, record.manifest.id), set()).add(record.instance_id)
    return tuple(
        NodeModelsView(
            node=member.id,
            host=member.host,
            status=member.status,
            models=tuple(
                _held(
                    h,
                    manifests.get(h.manifest_id),
                    names.get(h.manifest_id),
                    tuple(sorted(users.get((member.id, h.manifest_id), ()))),
                )
                for h in holdings.get(NodeId(member.id), NodeHoldings()).models
            ),
        )
        for member in members
    )

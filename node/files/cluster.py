"""This node's side of model files in the cluster: what it serves, what it advertises, what it fetches.

- `describe(source)`: a model this node resolved (a folder, an imported .gguf, a hub download) is
  hashed into its manifest (in a worker thread; the hash cache makes it a stat per file after the
  first time, restarts included) and offered to the cluster's members; the place request carries it.
- `folder_for(record, stage)`: the folder a stage placed here runs from: a copy this node serves
  whole already, or its own copy with this very content (`node.files.local_copy`: the folder the
  record's source names here, or a fresh import of the .gguf it came from when this node has that
  file, e.g. the built-in model's), else the files the stage needs (config, tokenizer and only its
  own shards), fetched into `<data_dir>/models/cluster/<manifest id>/` from the live peers that
  advertise them, and offered in turn. Raises `FetchError` (reported on the board and told to the
  cluster at once), `ValueError` or `OSError`.
- `files_unavailable(cluster, model)`: why no node can get a placed model's files (no live holder,
  no hub repo, no stage node with a copy of its own), for requests that would otherwise wait.
- `records()`: what the cluster driver writes at each heartbeat: the holdings (so peers know whom
  to ask) and the transfers (progress, for `/v1/cluster` and `shoal status`).
- `offer_stored()`: at start, the models fetched before a restart are offered again.

Files are served only to live members (`members`) who sign with the cluster key (`node.files`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import trio

from node.cluster.reader import ClusterReader
from node.files import Fetcher, FetchError, FileServer, HashCache, HubRef, Peer, cluster_model_dir
from node.files.folders import CLUSTER_SUBDIR
from node.files.hashing import folder_manifest
from node.files.local_copy import gguf_of, own_copy
from node.models import resolve_model
from node.models.disk import make_room, mark_used
from node.models.store import LocalModel, models_dir
from protocol.cluster_records import InstanceRecord, NodeHoldings, NodeTransfers, StageAssignment
from protocol.ids import NodeId
from protocol.manifest import Manifest, metadata_paths
from protocol.membership import Status
from protocol.model_files import (
    file_holders,
    files_unobtainable,
    heard_holders,
    holders_gone,
    holding_of,
)
from protocol.model_names import distinct_name, names_in_use
from protocol.record_limits import MAX_ERROR_CHARS, MAX_HOLDINGS, MAX_TEXT_CHARS, MAX_TRANSFERS

log = logging.getLogger("shoal.files")

HOLDERS_WAIT_S = 5.0
"""How long a stage waits for a holder of its files to be heard of before the fetch fails (and is
retried after a backoff): the instance record can arrive a heartbeat before the holder's holdings."""
HOLDERS_WAIT_CHECKS = 50
"""At most this many looks at the cluster state within `HOLDERS_WAIT_S` (one per change)."""
MANIFEST_SIDECAR = ".manifest.json"
"""In a folder fetched from peers: its manifest and the model's name, so a restarted node offers
it again without hashing. Hidden: never a manifest path, never listed as a model file."""


class FilesCluster(ClusterReader, Protocol):
    """What this module reads of the cluster (`node.cluster.service.ClusterService`)."""

    async def wait_changed(self) -> None: ...
    async def publish_own(self) -> None: ...


@dataclass(frozen=True)
class Described:
    """A model this node holds, as a place request names it."""

    manifest: Manifest
    hub_repo: str = ""
    """The Hugging Face repo it was downloaded from; empty for a folder or a .gguf."""
    name: str = ""
    """What the cluster calls it: its folder's name, made distinct if another model has that one."""


def live_members(cluster: FilesCluster) -> set[str]:
    """Who may download files here: the members alive or merely suspected now, and this node."""
    members = cluster.view.members.items()
    return {n for n, m in members if m.status in (Status.ALIVE, Status.SUSPECT)} | {cluster.me}


def alive_nodes(cluster: ClusterReader) -> set[NodeId]:
    """The members alive now, this node included: who can send files (a suspect may be gone)."""
    return set(cluster.view.alive()) | {cluster.me}


def files_unavailable(cluster: ClusterReader, model: str) -> str | None:
    """Why no instance of `model` can get its files (the first one's reason), or None when one can,
    or none is placed (`protocol.model_files.files_unobtainable`): a request for it ends at once."""
    state = cluster.state
    holdings, transfers, live = state.holdings(), state.transfers(), alive_nodes(cluster)
    records = [r for r in state.instances().values() if r.model == model]
    reasons = [files_unobtainable(r, holdings, transfers, live) for r in records]
    return reasons[0] if reasons and all(reasons) else None


def _write_sidecar(folder: Path, manifest: Manifest, model: str) -> None:
    body = {"model": model, "manifest": manifest.model_dump(mode="json")}
    (folder / MANIFEST_SIDECAR).write_text(json.dumps(body, separators=(",", ":")), encoding="utf-8")


def _read_sidecar(folder: Path) -> tuple[Manifest, str] | None:
    """The manifest and model name a fetched folder's sidecar records, if readable and the
    manifest id is the folder's name."""
    try:
        body = json.loads((folder / MANIFEST_SIDECAR).read_text(encoding="utf-8"))
        manifest, model = Manifest.model_validate(body["manifest"]), str(body["model"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return (manifest, model) if manifest.id == folder.name else None


def _read_sidecars(data_dir: Path) -> list[tuple[Manifest, Path, str]]:
    """The fetched folders with a readable sidecar, and the model's name."""
    root = models_dir(data_dir) / CLUSTER_SUBDIR
    found = [(folder, _read_sidecar(folder)) for folder in (sorted(root.iterdir()) if root.is_dir() else [])]
    return [(read[0], folder, read[1]) for folder, read in found if read is not None]


def placeable(models: Iterable[LocalModel], data_dir: Path) -> list[LocalModel]:
    """`models` as the dashboard offers them to place by name, each name once: a copy fetched from
    peers under the model's own name (its sidecar's; this node serves it by that name), and only a
    complete one (not a stage's shards, nor one whose sidecar is unreadable). Blocking."""
    root = (models_dir(data_dir) / CLUSTER_SUBDIR).resolve()

    def named(model: LocalModel) -> LocalModel | None:
        if not model.path.resolve().is_relative_to(root):
            return model
        read = _read_sidecar(model.path)
        try:
            whole = read is not None and all(
                (model.path / f.path).stat().st_size == f.size for f in read[0].files
            )
        except OSError:  # a file missing
            return None
        return dataclasses.replace(model, name=read[1] or model.name) if whole and read else None

    unique: dict[str, LocalModel] = {}
    for model in filter(None, map(named, models)):
        unique.setdefault(model.name, model)
    return list(unique.values())


class ClusterFiles:
    def __init__(
        self,
        cluster: FilesCluster,
        server: FileServer,
        fetcher: Fetcher,
        cache: HashCache,
        data_dir: Path,
        *,
        cap_bytes: int | None = None,
    ) -> None:
        self._cluster = cluster
        self.server = server
        self.fetcher = fetcher
        self._cache = cache
        self._data_dir = data_dir
        self._cap_bytes = cap_bytes
        self._held: dict[str, tuple[Manifest, Path]] = {}
        """manifest id -> (manifest, folder) of every offer, for advertising and for local use."""
        self._names: dict[str, str] = {}
        """manifest id -> the model's name (as instances call it), for `shoal models`."""
        self._described: dict[str, Described] = {}
        """source -> what `describe` found, for previews (which hash nothing)."""

    # --- what this node holds ------------------------------------------------------------------
    async def describe(self, source: str) -> Described:
        """Resolve `source`, hash the folder, offer it; raises `ValueError` or `OSError`. A whole
        copy fetched from peers (`cluster/<manifest id>`) keeps its manifest and name: its files no
        longer say which .gguf they came from."""
        resolved = await trio.to_thread.run_sync(resolve_model, source, self._data_dir)
        copy = self.named(f"{CLUSTER_SUBDIR}/{resolved.path.name}")
        if copy is not None and copy[1].resolve() == resolved.path.resolve():
            self._described[source] = Described(copy[0], "", copy[2])
            return self._described[source]
        manifest = await trio.to_thread.run_sync(
            functools.partial(
                folder_manifest,
                resolved.path,
                self._cache,
                derived_from=gguf_of(source, resolved, self._data_dir),
            )
        )
        name = self._names.get(manifest.id) or self._distinct(resolved.name, manifest.id)
        await self._offer(manifest, resolved.path, name)
        described = Described(manifest, resolved.name if resolved.source == "hub" else "", name)
        self._described[source] = described
        return described

    def _distinct(self, name: str, manifest_id: str) -> str:
        """`name`, or with a suffix when the cluster knows another model by it (`protocol.model_names`)."""
        state = self._cluster.state
        unique = distinct_name(name, manifest_id, names_in_use(state.holdings(), state.instances().values()))
        if unique != name:
            log.info("another model in the cluster is called %r: this one is served as %r", name, unique)
        return unique

    def named(self, name: str) -> tuple[Manifest, Path, str] | None:
        """The manifest, folder and name of a model this node serves whole under `name` (or as
        `cluster/<manifest id>`, as the data dir lists a copy from peers), if any."""
        offered = self.server.offered()
        for mid, (manifest, folder) in sorted(self._held.items()):
            model = self._names.get(mid, "")
            whole = offered.get(mid) == {f.path for f in manifest.files}
            if whole and name in (model, f"{CLUSTER_SUBDIR}/{mid}"):
                return manifest, folder, model
        return None

    def known(self, source: str) -> Described | None:
        """What the last `describe(source)` found, without touching the disk."""
        return self._described.get(source)

    async def offer_stored(self) -> None:
        """Offer again the folders fetched before this node (re)started."""
        for manifest, folder, model in await trio.to_thread.run_sync(_read_sidecars, self._data_dir):
            await self._offer(manifest, folder, model)

    def held(self) -> dict[str, tuple[str, Manifest]]:
        """manifest id -> (model name, manifest) of every model this node serves (no disk access)."""
        return {mid: (self._names.get(mid, ""), manifest) for mid, (manifest, _folder) in self._held.items()}

    async def _offer(self, manifest: Manifest, folder: Path, model: str) -> None:
        paths = await trio.to_thread.run_sync(self.server.offer, manifest, folder)
        self._held[manifest.id] = (manifest, folder)
        self._names[manifest.id] = model
        await self._cluster.publish_own()
        log.info(
            "serving %d of the %d file(s) of %s from %s",
            len(paths),
            len(manifest.files),
            manifest.id[:12],
            folder,
        )

    def _withdraw(self, folders: Collection[Path]) -> None:
        gone = {Path(f).resolve() for f in folders}
        for mid, (_manifest, folder) in list(self._held.items()):
            if folder.resolve() in gone:
                self.server.withdraw(mid)
                del self._held[mid]
                self._names.pop(mid, None)

    def members(self) -> set[str]:
        return live_members(self._cluster)

    # --- what the cluster state carries --------------------------------------------------------
    def records(self) -> tuple[NodeHoldings, NodeTransfers]:
        """This node's holdings and transfers records, as they are now (cheap: no disk access)."""
        offered = self.server.offered()
        models = []
        for mid in sorted(offered):
            manifest = self._held.get(mid, (None, None))[0]
            name = self._names.get(mid, "")[:MAX_TEXT_CHARS]
            holding = holding_of(manifest, offered[mid], name) if manifest else None
            if holding is not None:
                models.append(holding)
        moves = [
            t.model_copy(
                update={"model": t.model[:MAX_TEXT_CHARS], "error": t.error and t.error[:MAX_ERROR_CHARS]}
            )
            for t in self.fetcher.board.snapshots()
        ]
        return NodeHoldings(tuple(models[:MAX_HOLDINGS])), NodeTransfers(tuple(moves[-MAX_TRANSFERS:]))

    # --- what a stage placed here needs ----------------------------------------------------------
    async def folder_for(self, record: InstanceRecord, stage: StageAssignment) -> Path:
        """The folder `stage` of `record` runs from, fetched first when this node lacks files; a
        store folder is marked used, which orders `--max-model-bytes` evictions (a folder the user
        named is never written to)."""
        folder = await self._folder_for(record, stage)
        if record.manifest is not None:  # a failure to get these files is past: show it no more
            self.fetcher.board.forget_failed(record.manifest.id)
        if folder.resolve().is_relative_to(models_dir(self._data_dir).resolve()):
            await trio.to_thread.run_sync(mark_used, folder)
        return folder

    async def _folder_for(self, record: InstanceRecord, stage: StageAssignment) -> Path:
        manifest = record.manifest
        if manifest is None:  # a record without files: every node resolves its source itself
            return (
                await trio.to_thread.run_sync(resolve_model, record.source or record.model, self._data_dir)
            ).path
        held = self._held.get(manifest.id)
        if held is not None and self.server.offered().get(manifest.id) == {f.path for f in manifest.files}:
            return held[1]
        source = record.source or record.model
        own = await trio.to_thread.run_sync(own_copy, source, manifest, self._data_dir, self._cache)
        if own is not None:
            log.info("%s (%s) runs from this node's own copy in %s", record.model, manifest.id[:12], own)
            await self._offer(manifest, own, record.model)
            return own
        target = cluster_model_dir(self._data_dir, manifest.id)
        peers = await self._wait_for_holders(manifest)
        hub = HubRef(record.hub_repo, self._data_dir) if record.hub_repo else None
        try:
            if not peers and hub is None:
                raise FetchError(self._nowhere(manifest, record.model))
            await self._make_room(record, stage, target)
            if len(record.stages) == 1:
                folder = await self.fetcher.fetch(manifest, target, peers, hub=hub, model=record.model)
            else:
                folder = await self.fetcher.fetch_stage(
                    manifest,
                    target,
                    peers,
                    start=stage.start_layer,
                    end=stage.end_layer,
                    hub=hub,
                    model=record.model,
                )
        except FetchError as exc:
            await self._report(manifest, record.model, str(exc))
            raise
        if folder == target:
            await trio.to_thread.run_sync(_write_sidecar, target, manifest, record.model)
        await self._offer(manifest, folder, record.model)
        return folder

    async def _wait_for_holders(self, manifest: Manifest) -> list[Peer]:
        """The peers that hold files of `manifest`, waiting a little for the first one (bounded),
        unless those heard of holding them are all gone."""
        peers = self._peers(manifest)
        if not peers and holders_gone(manifest, self._cluster.state.holdings(), self._others_alive()):
            return peers
        with trio.move_on_after(HOLDERS_WAIT_S):
            for _check in range(HOLDERS_WAIT_CHECKS):
                if peers:
                    break
                await self._cluster.wait_changed()
                peers = self._peers(manifest)
        return peers

    def _peers(self, manifest: Manifest) -> list[Peer]:
        state = self._cluster.state
        urls = {node: profile.api_url for node, profile in state.profiles().items()}
        holders = file_holders(manifest, state.holdings(), urls, self._others_alive(), self._cluster.me)
        return [Peer(h.node, h.url, h.paths) for h in holders]

    def _others_alive(self) -> set[NodeId]:
        return alive_nodes(self._cluster) - {self._cluster.me}

    def _nowhere(self, manifest: Manifest, model: str) -> str:
        """Why no source of `manifest` is left, naming the holders that are gone."""
        known = heard_holders(manifest, self._cluster.state.holdings()) - {self._cluster.me}
        gone = sorted(node[-8:] for node in known)
        held = f" (the node(s) that held them, {', '.join(gone)}, are gone)" if gone else ""
        return (
            f"no peer holds the files of {model!r}{held}, it has no Hugging Face repo to fall back on, "
            "and this node has no copy of its own (the folder or .gguf its source names, the built-in model)"
        )

    async def _make_room(self, record: InstanceRecord, stage: StageAssignment, target: Path) -> None:
        """Evict unused models for what this stage may bring (`--max-model-bytes`). Its shards
        are known only once the weight index is here, so the need is estimated from the shape."""
        manifest = record.manifest
        if self._cap_bytes is None or manifest is None:
            return
        need = manifest.total_bytes
        if record.shape is not None and len(record.stages) > 1:
            meta = sum(f.size for f in manifest.files if f.path in metadata_paths(manifest))
            need = min(need, meta + record.shape.stage_bytes(stage.start_layer, stage.end_layer))
        in_use = {r.manifest.id for r in self._cluster.state.instances().values() if r.manifest is not None}
        keep = [target] + [folder for mid, (_m, folder) in self._held.items() if mid in in_use]
        evicted = await trio.to_thread.run_sync(make_room, self._data_dir, need, self._cap_bytes, keep)
        self._withdraw(evicted)

    async def _report(self, manifest: Manifest, model: str, reason: str) -> None:
        """Make a failure that happened before any byte moved (no peer holds the files) show on
        the board like one during a transfer, and tell the cluster now (requests waiting for the
        instance end at once when no node can get the files); the caller logs it."""
        mine = [t for t in self.fetcher.board.snapshots() if t.manifest_id == manifest.id]
        if not mine or mine[-1].state != "failed":
            self.fetcher.board.failed(manifest_id=manifest.id, model=model, source="peers", reason=reason)
        await self._cluster.publish_own()

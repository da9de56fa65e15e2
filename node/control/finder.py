"""A model placed by the name the cluster shows for it, from a node that cannot resolve that name.

`shoal run --model /some/folder/harbour-llama` on node A serves `harbour-llama`; after its instance is
deleted, `POST /v1/instances {"model": "harbour-llama"}` on node B (which cannot see the folder)
must still work. B's own resolution fails, so B asks: first itself (a copy it serves whole under that
name, fetched from peers earlier), then the live peers that advertise a model of that name in their
holdings, then every other live peer. The first that holds it answers with its shape and manifest
(`ModelDescribed`) and serves its files; B then places it like a model of its own, and the nodes
placed fetch the files from the holders (`node.files.cluster`).

A peer answers only for what it holds: a model it serves (under its name, or as `cluster/<manifest
id>`), the built-in model, or a model in its data dir by its plain name. Never a path or a hub
repo: those the asking node resolves itself.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Protocol

import trio

from node.cluster.reader import ClusterReader
from node.files.cluster import Described
from node.models import locate_model
from node.net.mesh import RequestError
from protocol.control_wire import (
    CONTROL_PROTOCOL,
    ControlWireError,
    DescribeModel,
    ModelDescribed,
    NotFound,
    decode_control,
    encode_control,
)
from protocol.ids import ModelId, NodeId
from protocol.manifest import Manifest
from protocol.model_names import holders_named
from protocol.placement import ModelShape

log = logging.getLogger("shoal.instances")

MAX_ASKED = 64
"""Peers asked at most for one name (holders first): a home cluster has a handful of nodes."""
LOCAL_SOURCES = ("builtin", "local")
"""What a peer describes for another node besides what it serves: the built-in model and models in
its data dir by their plain name (never a path of its disk or a download)."""


class Requester(Protocol):
    async def request(self, peer_id: str, payload: bytes, protocol: str = ...) -> bytes: ...


class HeldFiles(Protocol):
    """The models this node serves (`node.files.cluster.ClusterFiles`)."""

    def named(self, name: str) -> tuple[Manifest, Path, str] | None: ...
    async def describe(self, source: str) -> Described: ...


class ModelFinder:
    def __init__(
        self,
        cluster: ClusterReader,
        mesh: Requester,
        files: HeldFiles,
        folder_shape: Callable[[str, Path], Awaitable[ModelShape]],
        shape: Callable[[str], Awaitable[ModelShape]],
        data_dir: Path,
    ) -> None:
        self._cluster = cluster
        self._mesh = mesh
        self._files = files
        self._folder_shape = folder_shape
        """The shape of a whole folder served as a name (`node.control.shapes.ModelFiles`)."""
        self._shape = shape
        """The shape of a reference this node resolves (`node.control.shapes.ShapeCache.get`)."""
        self._data_dir = data_dir

    async def resolves_here(self, source: str) -> bool:
        """Whether this node resolves `source` itself, without asking (anything but a repo id or a
        name it does not know; the check reads the disk, so it runs in a worker thread)."""

        def here() -> bool:
            try:
                return locate_model(source, self._data_dir).source != "hub"
            except ValueError:
                return Path(source.strip()).expanduser().exists()  # a path, refused by its own rules

        return await trio.to_thread.run_sync(here)

    async def find(self, name: str) -> ModelDescribed | None:
        """`name` as this node or a live peer holds it (see the module); None when none does."""
        if (own := await self._own(name)) is not None:
            return own
        state, me = self._cluster.state, self._cluster.me
        live = self._cluster.view.alive()
        holders = holders_named(name, state.holdings(), live, me)
        others = sorted(live - set(holders) - {me})
        for peer in [*holders, *others][:MAX_ASKED]:
            answer = await self._ask(peer, name)
            if answer is not None:
                log.info("%r is held by %s: placing it from there", name, peer)
                return answer
        return None

    async def _ask(self, peer: NodeId, name: str) -> ModelDescribed | None:
        try:
            payload = await self._mesh.request(
                peer, encode_control(DescribeModel(name=name)), protocol=CONTROL_PROTOCOL
            )
            answer = decode_control(payload)
        except (RequestError, ControlWireError) as exc:
            log.debug("asking %s for %r failed: %s", peer, name, exc)
            return None
        return answer if isinstance(answer, ModelDescribed) else None

    async def _own(self, name: str) -> ModelDescribed | None:
        """A model this node serves whole under `name`."""
        held = self._files.named(name)
        if held is None:
            return None
        manifest, folder, model = held
        try:
            shape = await self._folder_shape(model, folder)
        except (ValueError, OSError) as exc:  # the folder changed under us: not usable by name
            log.warning("cannot read the shape of %s in %s: %s", model, folder, exc)
            return None
        return ModelDescribed(model=model, shape=shape, manifest=manifest)

    async def answer(self, request: DescribeModel) -> ModelDescribed | NotFound:
        """A peer asks for `request.name`: what this node serves by that name, else the built-in
        or a model of its data dir, described (hashed and offered) now."""
        name = request.name.strip()
        if (own := await self._own(name)) is not None:
            return own
        missing = NotFound(kind="model", reason=f"node {self._cluster.me} holds no model {name!r}")
        try:
            located = await trio.to_thread.run_sync(locate_model, name, self._data_dir)
            if located.source not in LOCAL_SOURCES:
                return missing
            described = await self._files.describe(name)
            shape = await self._shape(name)
        except (ValueError, OSError) as exc:
            log.debug("a peer asked for %r: %s", name, exc)
            return missing
        served = dataclasses.replace(shape, model=ModelId(described.name))
        return ModelDescribed(
            model=described.name, shape=served, manifest=described.manifest, hub_repo=described.hub_repo
        )

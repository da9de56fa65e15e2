"""Model files and shapes: what a node reads of a model to place it or to run it.

`ShapeCache` looks in its cache before it resolves anything: resolving can import a GGUF file or
download a repository, so a node asking to place (or preview) a model again reads nothing twice.
Only a requesting node reads shapes: the leader places and re-places with the shape the instance
record carries. `ModelFiles` is the I/O edge: resolution and the shape read run in worker
threads, never on the event loop.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import trio

from node.models import ResolvedModel, resolve_model
from node.models.shape import model_shape
from protocol.placement import ModelShape


@dataclass(frozen=True)
class ModelFiles:
    """Resolves model references in `data_dir` and reads their shape as this node's runners count it."""

    data_dir: Path
    runtime_dtype_bytes: int | None
    kernels: bool

    async def resolve(self, source: str) -> ResolvedModel:
        """The model folder; raises `ValueError` (`ModelResolveError`) when `source` names none."""
        return await trio.to_thread.run_sync(resolve_model, source, self.data_dir)

    async def shape(self, source: str) -> ModelShape:
        """Resolve `source`, then read its shape (`shape.model` is the id it is served as)."""
        resolved = await self.resolve(source)
        return await self.folder_shape(resolved.name, resolved.path)

    async def folder_shape(self, name: str, folder: Path) -> ModelShape:
        """The shape of the complete model folder `folder`, served as `name`."""
        return await trio.to_thread.run_sync(
            lambda: model_shape(
                name, folder, runtime_dtype_bytes=self.runtime_dtype_bytes, kernels=self.kernels
            )
        )


class ShapeCache:
    """Model shapes by source, filled by this node's place and preview requests."""

    def __init__(self, read: Callable[[str], Awaitable[ModelShape]]) -> None:
        self._read = read
        self._shapes: dict[str, ModelShape] = {}

    def remember(self, source: str, shape: ModelShape) -> None:
        """Keep `shape` for `source` unless one is known already (the first reading wins)."""
        self._shapes.setdefault(source, shape)

    async def get(self, source: str) -> ModelShape:
        """The cached shape, else read (resolving the model) and cached; `ValueError` when unreadable."""
        if (known := self._shapes.get(source)) is not None:
            return known
        shape = await self._read(source)
        self.remember(source, shape)
        return self._shapes[source]

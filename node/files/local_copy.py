"""This node's own copy of a model: a source like a peer, and the first one asked.

A stage placed here with a record's manifest runs from a copy this node has on its own when that
copy has the manifest's very content (`own_copy`):

1. the folder the record's source names here: a folder every node sees, a model in the data dir,
   an earlier import or download (hashed; the hash cache makes that a stat per file);
2. else a fresh import of a `.gguf` this node has that is the file the manifest was derived from
   (`Manifest.derived_from`: its name, size and SHA-256): the record's source path when that file
   exists here too, or the built-in model's GGUF of this node's own install. So a node that never
   ran the built-in takes it over from a dead holder in the ~5 s of an import, with no peer.

The import is deterministic: the same `.gguf` gives the same bytes on every node (the importer's
marker, which names the file's path on the importing node, is left out of manifests:
`node.files.hashing`), and the result is checked against the whole manifest before it is used.
Nothing is downloaded. Blocking (hashing, an import in a child process): call it from a worker
thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path

from node.files.hashing import HashCache, file_entry, folder_manifest
from node.models import (
    ResolvedModel,
    builtin_gguf_path,
    ensure_builtin_model,
    ensure_gguf_model,
    locate_model,
)
from node.models.store import ModelResolveError, is_model_dir
from protocol.manifest import Manifest

log = logging.getLogger("shoal.files")

Importer = Callable[[], Path]
"""Imports a `.gguf` (in a child process, once: `ensure_gguf_model`); returns the folder."""


def gguf_of(source: str, located: ResolvedModel, data_dir: Path) -> Path | None:
    """The .gguf that `source`'s folder is imported from, recorded in its manifest (`derived_from`);
    None for a folder, a model in the data dir or a hub download."""
    if located.source == "gguf":
        return Path(source.strip()).expanduser().resolve()
    if located.source == "builtin":
        return builtin_gguf_path(data_dir)
    return None


def own_copy(source: str, manifest: Manifest, data_dir: Path, cache: HashCache) -> Path | None:
    """A folder of this node with exactly `manifest`'s content, found or imported (see the module
    docstring); None when this node has no such copy. Never raises for a copy that is not there."""
    try:
        located: ResolvedModel | None = locate_model(source, data_dir)
    except ModelResolveError:  # not here under that name: a .gguf of it may be
        located = None
    if located is not None and (found := _existing(source, located, manifest, data_dir, cache)):
        return found
    for gguf, make in _ggufs(source, located, data_dir):
        if not _derived_from(gguf, manifest, cache):
            continue
        log.info("importing %s here: this node's own copy of %s, no peer needed", gguf, manifest.id[:12])
        try:
            folder = make()
            here = folder_manifest(folder, cache, derived_from=gguf)
        except (ValueError, OSError) as exc:  # GGUFImportError is a ValueError
            log.warning("cannot import %s here (%s): the model's files come from peers", gguf, exc)
            continue
        if here == manifest:
            return folder
        log.warning(
            "the import of %s here is not the cluster's copy of %s (%s): it comes from peers",
            gguf,
            manifest.id[:12],
            _difference(here, manifest),
        )
    return None


def _existing(
    source: str, located: ResolvedModel, manifest: Manifest, data_dir: Path, cache: HashCache
) -> Path | None:
    """The folder `located` names, if it is there already with `manifest`'s content."""
    try:
        gguf = gguf_of(source, located, data_dir)
        if not is_model_dir(located.path) or (gguf is not None and not gguf.is_file()):
            return None
        here = folder_manifest(located.path, cache, derived_from=gguf)
    except (ValueError, OSError):  # not readable, or the built-in's GGUF not installed: look further
        return None
    return located.path if here == manifest else None


def _ggufs(source: str, located: ResolvedModel | None, data_dir: Path) -> Iterator[tuple[Path, Importer]]:
    """The `.gguf` files of this node that could be the manifest's source, each with its import:
    the one `source` names (when it exists here), then the built-in model's (when installed)."""
    seen: set[Path] = set()
    if located is not None and located.source == "gguf":
        path, target = Path(source.strip()).expanduser().resolve(), located.path
        seen.add(path)
        yield path, lambda: ensure_gguf_model(path, target)
    try:
        builtin = builtin_gguf_path(data_dir).resolve()
    except ModelResolveError:  # not installed on this node
        return
    if builtin not in seen:
        yield builtin, lambda: ensure_builtin_model(data_dir)


def _derived_from(gguf: Path, manifest: Manifest, cache: HashCache) -> bool:
    """Whether `gguf` is the file `manifest` was imported from (name and size first: a hash of a
    file that cannot be it is never read)."""
    want = manifest.derived_from
    if want is None or gguf.name != want.path:
        return False
    try:
        return gguf.stat().st_size == want.size and file_entry(gguf, gguf.name, cache) == want
    except OSError:
        return False
    finally:
        cache.save()


def _difference(here: Manifest, want: Manifest) -> str:
    """Which files differ, for the log: an importer that changed between the nodes' versions."""
    mine, theirs = set(here.files), set(want.files)
    paths = sorted({f.path for f in mine ^ theirs})
    return f"{len(paths)} file(s) differ: {', '.join(paths[:4])}" if paths else "the source entry differs"

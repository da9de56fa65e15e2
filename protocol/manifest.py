"""A model's content identity, which of its files a pipeline stage needs, and transfer progress. Pure.

A model in the cluster is named by its `Manifest`: every file with its size and SHA-256, plus, for
a folder imported from a `.gguf`, the entry of that source file. `manifest.id` is the SHA-256 of a
canonical encoding (`canonical_bytes`), so the same content has the same id on every node, whatever
the folder is called or where it came from.

Manifests travel between nodes (in instance records, in file URLs): every field is checked when a
manifest is built, with named size limits, and paths can never leave the model's folder (relative,
`/`-separated, no `.`/`..`/hidden segments, no backslash or control characters).

Which files a stage needs is decided from the safetensors index's `weight_map` (tensor name ->
shard file): the layers `[start, end)`, the token embedding for the first stage, the final norm and
head for the last one (and the embedding there too when the head is tied to it), plus every file
that is not a weight shard (config, tokenizer, templates, the index itself).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import re
from collections.abc import Collection, Iterable, Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MANIFEST_VERSION = 1
"""Bump when the canonical encoding changes: ids of different versions never collide."""
MAX_MANIFEST_FILES = 512
"""Files in one model. The largest public checkpoints have ~200 shards (Llama-3.1-405B: 191)."""
MAX_PATH_CHARS = 200
"""One relative path. With 512 files a manifest stays under ~150 KB encoded (a typical one: ~5 KB)."""
MAX_FILE_BYTES = 2**50
"""1 PiB: any size above is a broken or hostile manifest."""
WEIGHT_SUFFIX = ".safetensors"
INDEX_FILE = "model.safetensors.index.json"
"""The weight map of a sharded checkpoint; a model without one keeps all weights in its shards."""

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
"""`model.layers.12.mlp...` -> 12. Tensors outside every layer are the ends (embedding, norm, head)."""
_EMBEDDING = re.compile(r"(?:^|\.)(embed_tokens|wte|tok_embeddings|word_embeddings)\.")
_HEAD = re.compile(r"(?:^|\.)(lm_head|output)\.")


class ManifestError(ValueError):
    """A manifest, index or config that breaks the rules above; the message says which rule."""


def check_path(path: str) -> str:
    """`path` if it is a safe relative path inside a model folder, else ManifestError."""
    if not path or len(path) > MAX_PATH_CHARS:
        raise ManifestError(f"a file path must have 1..{MAX_PATH_CHARS} characters, got {len(path)}")
    if "\\" in path or any(ord(c) < 32 or ord(c) == 127 for c in path):
        raise ManifestError(f"file path {path!r} has a backslash or a control character")
    for part in path.split("/"):
        if not part or part.startswith("."):
            raise ManifestError(f"file path {path!r} has an empty, relative or hidden segment")
    return path


class FileEntry(BaseModel):
    """One file of a model: where it lies in the folder, its length and its SHA-256 (lowercase hex)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    path: str
    size: int = Field(ge=0, le=MAX_FILE_BYTES)
    sha256: str

    @field_validator("path")
    @classmethod
    def _path(cls, value: str) -> str:
        return check_path(value)

    @field_validator("sha256")
    @classmethod
    def _sha(cls, value: str) -> str:
        if not _SHA256_HEX.fullmatch(value):
            raise ManifestError("sha256 must be 64 lowercase hex digits")
        return value


class Manifest(BaseModel):
    """A model's files, sorted by path (each path once); `id` names this exact content.

    Built from untrusted data with `Manifest.model_validate(obj)`; any broken rule raises pydantic's
    ValidationError (a ValueError) naming it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: Literal[1] = 1
    """`MANIFEST_VERSION`."""
    files: tuple[FileEntry, ...]
    derived_from: FileEntry | None = None
    """The source a folder was imported from (a `.gguf`: its file name, size and hash), else None."""

    @model_validator(mode="after")
    def _sorted_and_unique(self) -> Manifest:
        if len(self.files) > MAX_MANIFEST_FILES:
            raise ManifestError(f"{len(self.files)} files exceed {MAX_MANIFEST_FILES}")
        paths = [f.path for f in self.files]
        if any(a >= b for a, b in itertools.pairwise(paths)):
            raise ManifestError("files must be sorted by path, each path once (use `manifest_of`)")
        prefixes = {path[:i] for path in paths for i, c in enumerate(path) if c == "/"}
        if clash := prefixes.intersection(paths):
            raise ManifestError(f"{sorted(clash)[0]!r} is both a file and a folder")
        return self

    @functools.cached_property
    def id(self) -> str:
        """SHA-256 (hex) of `canonical_bytes(self)`: equal ids mean equal manifests."""
        return hashlib.sha256(canonical_bytes(self)).hexdigest()

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def entry(self, path: str) -> FileEntry | None:
        return self._by_path.get(path)

    def subset(self, paths: Collection[str]) -> tuple[FileEntry, ...]:
        """The entries of `paths`, in manifest order; ManifestError names a path the model lacks."""
        if missing := set(paths) - self._by_path.keys():
            raise ManifestError(f"the model has no file {sorted(missing)[0]!r}")
        return tuple(f for f in self.files if f.path in paths)

    @functools.cached_property
    def _by_path(self) -> dict[str, FileEntry]:
        return {f.path: f for f in self.files}


def manifest_of(files: Iterable[FileEntry], derived_from: FileEntry | None = None) -> Manifest:
    """A manifest of `files` in any order (sorted here)."""
    return Manifest(files=tuple(sorted(files, key=lambda f: f.path)), derived_from=derived_from)


def canonical_bytes(manifest: Manifest) -> bytes:
    """The encoding the id hashes: compact JSON, keys sorted, UTF-8. Never change it within a version."""
    plain = manifest.model_dump(mode="json")
    return json.dumps(plain, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


# --- what one pipeline stage needs -----------------------------------------------------------------


def is_weight_file(path: str) -> bool:
    return path.endswith(WEIGHT_SUFFIX)


def metadata_paths(manifest: Manifest) -> frozenset[str]:
    """Every file that is not a weight shard: config, tokenizer, templates, the index. Small; every
    stage needs them, and they are fetched first, to learn which shards the stage needs."""
    return frozenset(f.path for f in manifest.files if not is_weight_file(f.path))


def weight_map(index: object) -> dict[str, str]:
    """The `weight_map` of a parsed `model.safetensors.index.json`, checked: tensor name -> shard."""
    mapping = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(mapping, dict) or not mapping:
        raise ManifestError(f"{INDEX_FILE} has no weight_map object")
    for tensor, shard in mapping.items():
        if not isinstance(tensor, str) or not isinstance(shard, str) or not is_weight_file(shard):
            raise ManifestError(f"{INDEX_FILE}: {tensor!r} maps to {shard!r}, not a .safetensors file")
        check_path(shard)
    return mapping


def stage_shards(
    mapping: Mapping[str, str], *, start: int, end: int, num_layers: int, tied_embeddings: bool | None = None
) -> frozenset[str]:
    """The shards holding the tensors of a stage that runs layers `[start, end)` of `num_layers`.

    The first stage also needs the token embedding; the last the final norm and head, and the
    embedding too when the head is tied to it (`tied_embeddings`; None: tied when the map has no
    head tensor). Any other tensor outside the layers goes to the last stage.
    """
    if not 0 <= start < end <= num_layers:
        raise ManifestError(f"layer range [{start}, {end}) is not a non-empty part of {num_layers} layers")
    first, last = start == 0, end == num_layers
    if tied_embeddings is None:
        tied_embeddings = not any(_HEAD.search(name) for name in mapping)
    shards: set[str] = set()
    for tensor, shard in mapping.items():
        if layer := _LAYER.search(tensor):
            needed = start <= int(layer.group(1)) < end
        elif _EMBEDDING.search(tensor):
            needed = first or (last and tied_embeddings)
        else:
            needed = last
        if needed:
            shards.add(shard)
    return frozenset(shards)


def stage_paths(
    manifest: Manifest, index: object | None, config: object, *, start: int, end: int
) -> frozenset[str]:
    """The files of `manifest` a stage running layers `[start, end)` needs: its metadata files and
    shards. `index` is the parsed weight-map file (None when the model has none: then every shard
    is needed), `config` the parsed `config.json` (for the layer count and tied embeddings)."""
    if not isinstance(config, dict) or not isinstance(config.get("num_hidden_layers"), int):
        raise ManifestError("config.json has no integer num_hidden_layers")
    wanted = set(metadata_paths(manifest))
    if index is None:
        wanted |= {f.path for f in manifest.files if is_weight_file(f.path)}
    else:
        tied = config.get("tie_word_embeddings")
        shards = stage_shards(
            weight_map(index),
            start=start,
            end=end,
            num_layers=config["num_hidden_layers"],
            tied_embeddings=tied if isinstance(tied, bool) else None,
        )
        manifest.subset(shards)  # every shard the index names must be a file of the model
        wanted |= shards
    return frozenset(wanted)


# --- progress -------------------------------------------------------------------------------------

TransferSource = Literal["peers", "hub"]
TransferState = Literal["fetching", "done", "failed"]


class TransferProgress(BaseModel):
    """One model's files moving to one node, as the cluster view and `shoal status` show it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    manifest_id: str
    """The manifest's id; empty for a hub download of a model no node has described yet."""
    model: str
    """What the user calls it (a repo id, a folder name), for display."""
    source: TransferSource
    state: TransferState
    bytes_done: int = Field(ge=0)
    bytes_total: int = Field(ge=0)
    """0 when unknown (a hub download before its listing)."""
    rate_bps: float = Field(ge=0)
    """Bytes per second over the last few seconds."""
    files_done: int = Field(ge=0)
    files_total: int = Field(ge=0)
    peers: int = Field(ge=0)
    """Peers sending to this node now."""
    error: str | None = None
    """Why the transfer failed (state `failed`), else None."""

    @property
    def fraction(self) -> float:
        """Done / total in [0, 1]; 0 while the total is unknown, 1 when done."""
        if self.state == "done":
            return 1.0
        return min(1.0, self.bytes_done / self.bytes_total) if self.bytes_total else 0.0

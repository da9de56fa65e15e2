"""What `shoal run --model X` makes sure of before the node starts, so that a model this node can
never serve stops it at once (exit 2, the reason on stderr) instead of leaving a node that serves
nothing while a service manager sees success.

- Every reference: `locate_model` (a path that does not exist); a plain name this node lacks is
  left to the cluster (`preflight` returns None).
- The built-in model: its GGUF is installed, or in the data dir, or downloaded now
  (`node.models.builtin_fetch`); without network and file the node does not start.
- A `.gguf` not imported yet: its header, read in a child process (numpy and gguf-py stay out of
  the node, as for the import itself): the architecture and its settings (`build_config`: bert,
  mamba, partial rotary, yarn ... are refused), the tensor names, and each tensor's type (Q2_K, Q3_K, IQ*, ...
  are refused), and the tokenizer's kind and pre-tokenizer name (SentencePiece vocabularies, an
  unknown `tokenizer.ggml.pre`). A file gguf-py cannot read (truncated, not a GGUF) is refused too.
  ~1-3 s (a gpt-oss vocabulary of 201,088 tokens and 446,189 merges included: `gguf_reader`).

What only the import finds (a malformed vocabulary, scales that overflow float16) still
fails after the start: `InstanceRequests.ensure` then ends the node with exit 2 as well.

`python -m node.models.preflight FILE.gguf` is the child: its last stdout line is JSON, `{"ok":
true}` (exit 0) or `{"error": "..."}` (exit 2).
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

from node.models.gguf import is_current_import
from node.models.json_child import GGUFImportError, child_main, run_child
from node.models.resolve import is_plain_name, locate_model
from node.models.store import ModelResolveError, ResolvedModel

log = logging.getLogger("shoal.models")

CHECK_MODULE = "node.models.preflight"
CHECK_TIMEOUT_S = 60.0
"""The header check reads metadata only (a 150k-token vocabulary is the largest part: ~1 s here);
a child still running after this long is given up on, and the node starts without the check."""


def preflight(ref: str, data_dir: Path) -> ResolvedModel | None:
    """Raise `ModelResolveError` (a `ValueError`) with the reason when `ref` can never be served
    here; download the built-in model's file if it is needed and missing. Blocking. None: a plain
    name this node does not have, which the cluster may (`node.control.finder`): the node starts and
    asks it, and exits 2 when no node holds it either (`InstanceRequests.ensure`)."""
    try:
        located = locate_model(ref, data_dir)
    except ModelResolveError:
        name = ref.strip()
        if not is_plain_name(name) or name.lower().endswith(".gguf"):  # a path or a file: here or nowhere
            raise
        log.info("%r is not a model of this node: the cluster is asked for it once it forms", ref)
        return None
    if located.source == "builtin":
        from node.models.builtin_fetch import fetch_builtin_gguf

        fetch_builtin_gguf(data_dir)
    elif located.source == "gguf":
        gguf = Path(ref.strip()).expanduser().resolve()
        if not is_current_import(located.path, gguf):
            try:
                check_gguf(gguf)
            except GGUFImportError as exc:
                raise GGUFImportError(f"cannot serve {ref!r}: {exc}") from exc
    return located


def check_gguf(path: Path) -> None:
    """Raise `GGUFImportError` when the import would refuse `path` for what its header says."""
    try:
        done = run_child(CHECK_MODULE, [str(path)], timeout=CHECK_TIMEOUT_S, tail_chars=500)
    except subprocess.TimeoutExpired:
        log.warning("checking %s took over %.0f s; starting without the check", path, CHECK_TIMEOUT_S)
        return
    done.raise_refusal()
    if done.returncode != 0 or not done.answer.get("ok"):  # the checker itself broke: the import will tell
        log.warning("could not check %s before starting (exit %d): %s", path, done.returncode, done.tail)


def check_header(path: Path) -> None:
    """The checks of the import that need no tensor data; raises `GGUFImportError`."""
    from gguf import GGMLQuantizationType

    from node.models.gguf_arch import check_tensor_names
    from node.models.gguf_convert import check_type, header_config, read_gguf
    from node.models.gguf_tokenizer import GGUFTokenizerError, check_tokenizer_kind

    reader, meta = read_gguf(path)
    arch, by_name, config = header_config(reader, meta)
    check_tensor_names(by_name, arch, config["num_hidden_layers"])
    for name, tensor in by_name.items():
        check_type(name, GGMLQuantizationType(int(tensor.tensor_type)))
    try:
        check_tokenizer_kind(meta)
    except GGUFTokenizerError as exc:
        raise GGUFImportError(str(exc)) from exc


def _check(path: Path) -> dict[str, bool]:
    check_header(path)
    return {"ok": True}


def main(argv: list[str]) -> int:
    return child_main(argv, "node.models.preflight FILE.gguf", _check)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The one protocol of the GGUF child processes (the import, `node.models.gguf_child`, and the header
check, `node.models.preflight`): numpy and gguf-py run there, never in the node.

The child's last stdout line is JSON: its answer (exit 0), or `{"error": "..."}` with exit
`CHILD_IMPORT_ERROR_RC` for a `GGUFImportError` (a refused file), whose message the parent raises
again. Anything else is a crash, which the parent reports with the output's tail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from node.models.store import ModelResolveError

CHILD_IMPORT_ERROR_RC = 2
"""The child refused the file (a `GGUFImportError`); its message is the JSON line's `error`."""
USAGE_RC = 64
"""The child was called with the wrong arguments (EX_USAGE)."""


class GGUFImportError(ModelResolveError):
    """A .gguf file that cannot be turned into a faithful mlx-lm model folder."""


def child_main(argv: list[str], usage: str, work: Callable[..., dict[str, Any]]) -> int:
    """Run `work(*paths)` on the command line's paths (`usage`: the module, then one word per path)
    and print its answer, or its refusal, as the last JSON line."""
    if len(argv) != len(usage.split()) - 1:
        print(f"usage: python -m {usage}", file=sys.stderr)
        return USAGE_RC
    try:
        answer = work(*(Path(arg) for arg in argv))
    except GGUFImportError as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
        return CHILD_IMPORT_ERROR_RC
    print(json.dumps(answer), flush=True)
    return 0


@dataclass(frozen=True)
class ChildAnswer:
    returncode: int
    answer: dict[str, Any]
    """The last stdout line as JSON (empty when it is not)."""
    tail: str
    """The end of stderr (else stdout): what a crash said."""

    def raise_refusal(self) -> None:
        """Raise the child's `GGUFImportError` again, if it refused the file."""
        if self.returncode == CHILD_IMPORT_ERROR_RC and "error" in self.answer:
            raise GGUFImportError(str(self.answer["error"]))


def run_child(module: str, args: list[str], *, timeout: float, tail_chars: int = 2000) -> ChildAnswer:
    """`python -m module args...` with this checkout importable; raises `subprocess.TimeoutExpired`."""
    root = str(Path(__file__).resolve().parents[2])  # the folder that holds the `node` package
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", module, *args]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout, check=False)
    lines = done.stdout.strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if lines else {}
    except ValueError:
        answer = {}
    tail = (done.stderr or done.stdout).strip()[-tail_chars:]
    return ChildAnswer(done.returncode, answer if isinstance(answer, dict) else {}, tail)

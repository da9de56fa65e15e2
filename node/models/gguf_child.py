"""`python -m node.models.gguf_child SRC DST`: one GGUF import, in a process of its own.

`ensure_gguf_model` runs this so that the weights pass through this process's memory and not the
node's. The last stdout line is JSON (`node.models.json_child`): `{"summary": "..."}` (exit 0) or
`{"error": "..."}` (exit 2, a `GGUFImportError`, whose message the parent raises again).
"""

from __future__ import annotations

import sys
from pathlib import Path

from node.models.gguf_convert import convert
from node.models.json_child import child_main


def _import(source: Path, target: Path) -> dict[str, str]:
    return {"summary": convert(source, target)}


def main(argv: list[str]) -> int:
    return child_main(argv, "node.models.gguf_child SRC.gguf DST_DIR", _import)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

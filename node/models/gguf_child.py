"""`python -m node.models.gguf_child SRC DST`: one GGUF import, in a process of its own.

`ensure_gguf_model` runs this so that the weights pass through this process's memory and not the
node's. The last stdout line is JSON: `{"summary": "..."}` (exit 0) or `{"error": "..."}` (exit 2,
a `GGUFImportError`, whose message the parent raises again). Anything else is a crash, which the
parent reports with the stderr tail.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from node.models.gguf import CHILD_IMPORT_ERROR_RC, GGUFImportError
from node.models.gguf_convert import convert


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m node.models.gguf_child SRC.gguf DST_DIR", file=sys.stderr)
        return 64
    try:
        summary = convert(Path(argv[0]), Path(argv[1]))
    except GGUFImportError as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
        return CHILD_IMPORT_ERROR_RC
    print(json.dumps({"summary": summary}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

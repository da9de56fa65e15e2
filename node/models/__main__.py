"""`python -m node.models [DATA_DIR]`: import the built-in model from its GGUF (`shoal prepare`
also fetches the file when it is missing)."""

import sys

from node.models.builtin import main

sys.exit(main())

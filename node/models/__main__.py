"""`python -m node.models [DATA_DIR]`: get the built-in model's GGUF (downloaded when missing) and
import it, as `shoal prepare` does without the harmony vocab."""

import sys

from node.models.builtin import main

sys.exit(main())

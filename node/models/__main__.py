"""`python -m node.models [DATA_DIR]`: prepare the built-in model (what `make install` runs)."""

import sys

from node.models.builtin import main

sys.exit(main())

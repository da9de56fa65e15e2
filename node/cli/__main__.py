"""`python -m node.cli`: the `shoal` command."""

import sys

from node.cli.main import main

sys.exit(main())

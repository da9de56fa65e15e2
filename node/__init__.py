"""The Shoal node process: CLI, runner supervision and (later) networking."""

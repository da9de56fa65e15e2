"""The `shoal` command: `main` (`shoal run`, `shoal prepare`), `status` (`shoal status`) and
`models` (`shoal models`). `python -m node.cli` runs it too."""

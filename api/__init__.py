"""Shoal's OpenAI-compatible HTTP API. Depends on `protocol/` and on the `Backend` the node hands it."""

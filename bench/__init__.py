"""Benchmarks: scripts run as `.venv/bin/python bench/NAME.py`; `common` holds what they share."""

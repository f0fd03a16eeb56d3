"""Benchmarks: `python -m bench NAME` (see `__main__.py`)."""

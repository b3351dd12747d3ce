"""Benchmarks: run as `python -m baton.tools.bench.<name>`."""

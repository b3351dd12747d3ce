"""Benchmarks: run as `python -m services.bench.<name>`."""

"""Blocks as bytes (the engine's own codec, re-exported for the connectors)."""

from services.engine.kv_blocks import read_blocks, write_blocks

__all__ = ["read_blocks", "write_blocks"]

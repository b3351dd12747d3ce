"""KV offload tiers: the block store every tier is built on (store.py)."""

"""What the engine-side services share: the engine loop thread behind asyncio, the stats
and KV-bytes servicer, and the colocated Generation servicer."""

"""What every worker shares: the engine on its own thread behind asyncio, the worker
config, the WorkerService, and proto messages from engine types."""

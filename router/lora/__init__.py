"""LoRA on the router's side, in one place: the adapters served by name and path, loaded
and unloaded on every worker (registry.py), and their OpenAI-compatible routes and
`model` lookup (routes.py, FastAPI's; nothing else here imports it). The gRPC
Generation service's LoadLoraAdapter and UnloadLoraAdapter (server.py) call the
registry."""

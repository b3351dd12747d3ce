"""KV transfer connectors: NIXL, gRPC fallback, in-memory fake (the gRPC services issue)."""

"""KV transfer connectors (NIXL, gRPC fallback, in-memory fake). Filled by the gRPC services issue."""

"""Public front door: Generate API, routing, P/D orchestration (the gRPC services issue)."""

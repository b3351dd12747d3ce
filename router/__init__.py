"""Public front door (Generate API, routing, P/D orchestration). Filled by the gRPC services issue."""

"""aio gRPC server bootstrap and config. Filled by the gRPC services issue."""

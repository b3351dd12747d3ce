"""gRPC servicer around an engine in the decode role. Filled by the gRPC services issue."""

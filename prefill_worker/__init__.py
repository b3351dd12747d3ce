"""gRPC servicer around an engine in the prefill role. Filled by the gRPC services issue."""

"""Errors every layer may raise, torch- and gRPC-free; the services' one interceptor
(services/rpc/server.py) gives each its status code."""


class NotFound(Exception):
    """A named thing this service does not hold (a LoRA adapter): NOT_FOUND, or 404."""

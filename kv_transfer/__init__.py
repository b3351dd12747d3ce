"""KV block transfer between engines: the connector interface (base), NIXL, a gRPC-stream
fallback, and an in-memory fake for tests."""

from __future__ import annotations

import torch

from kv_transfer.base import KVLayout, KVReceiver, KVSender


def default_transport() -> str:
    """NIXL when its library loads here, else the gRPC fallback."""
    try:
        import nixl_cu12  # noqa: F401
    except ImportError:
        return "grpc"
    return "nixl"


def make_sender(transport: str, engine_id: str, layout: KVLayout,
                kv_caches: list[torch.Tensor]) -> KVSender:
    if transport == "nixl":
        from kv_transfer.nixl_connector import NixlConnector

        return NixlConnector(engine_id, layout, kv_caches)
    if transport == "grpc":
        from kv_transfer.grpc_stream import GrpcStreamSender

        return GrpcStreamSender()
    raise ValueError(f"unknown KV transport {transport!r} (nixl or grpc)")


def make_receiver(transport: str, engine_id: str, layout: KVLayout,
                  kv_caches: list[torch.Tensor], fetch=None) -> KVReceiver:
    """`fetch(engine_id, block_ids)` yields block bytes; the gRPC transport needs it."""
    if transport == "nixl":
        from kv_transfer.nixl_connector import NixlConnector

        return NixlConnector(engine_id, layout, kv_caches)
    if transport == "grpc":
        from kv_transfer.grpc_stream import GrpcStreamReceiver

        return GrpcStreamReceiver(layout, kv_caches, fetch)
    raise ValueError(f"unknown KV transport {transport!r} (nixl or grpc)")

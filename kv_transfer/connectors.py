"""The connectors by transport name: NIXL or the gRPC-stream fallback. Importing this
module (or `baton.kv_transfer.base`, the contract) loads no torch: a connector's module is
imported when one is made."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .base import KVLayout, KVReceiver, KVSender
    from .grpc_stream import Fetch

TRANSPORTS = ("nixl", "grpc")


def default_transport() -> str:
    """NIXL when its library loads here, else the gRPC fallback."""
    try:
        import nixl_cu12  # noqa: F401
    except ImportError:
        return "grpc"
    return "nixl"


def make_sender(transport: str, engine_id: str, layout: KVLayout, rank_caches: list) -> KVSender:
    if transport == "nixl":
        from .nixl_connector import NixlConnector

        return NixlConnector(engine_id, layout, rank_caches)
    if transport == "grpc":
        from .grpc_stream import GrpcStreamSender

        return GrpcStreamSender()
    raise ValueError(f"unknown KV transport {transport!r} (nixl or grpc)")


def make_receiver(transport: str, engine_id: str, layout: KVLayout, rank_caches: list,
                  fetch: Fetch | None = None) -> KVReceiver:
    """`fetch(handle, block_ids, heads)` yields block bytes; the gRPC transport needs it.
    `rank_caches` is every tensor-parallel rank's layer tensors (`[rank][layer]`), here
    and in make_sender."""
    if transport == "nixl":
        from .nixl_connector import NixlConnector

        return NixlConnector(engine_id, layout, rank_caches)
    if transport == "grpc":
        from .grpc_stream import GrpcStreamReceiver

        if fetch is None:
            raise ValueError("the gRPC transport needs a fetch function")
        return GrpcStreamReceiver(layout, rank_caches, fetch)
    raise ValueError(f"unknown KV transport {transport!r} (nixl or grpc)")

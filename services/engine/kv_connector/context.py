"""What a connector is built from (registry.py hands it to each factory)."""

from __future__ import annotations

from dataclasses import dataclass

from baton.kv_transfer.base import KVLayout, KVReceiver

from ...common.kv_events import KvEventLog
from ..config import EngineConfig


@dataclass
class ConnectorContext:
    """What a connector may be built from: the engine's settings, its KV layout and
    every tensor-parallel rank's caches (`[rank][layer]`), its receiver (decode role),
    its KV event log (what routers learn of the blocks it holds), and which weights it
    computes with (model_source.weights_identity)."""

    config: EngineConfig
    layout: KVLayout
    rank_caches: list[list]
    receiver: KVReceiver | None
    events: KvEventLog
    weights: str = ""

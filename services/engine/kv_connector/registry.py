"""Connectors by name: `--kv-connector NAME[,NAME]` picks them, in the order given; the
first one that has something for a request loads it (kv_loads.py), and every one saves.

    pd        the P/D pull (decode role: the engine has a KV receiver)
    offload   the host and disk tiers (--kv-offload-gib, --kv-offload-disk-path)

Left unnamed (""), an engine stacks what its settings call for: "pd" where it has a
receiver, then "offload" where a tier is set.
"""

from __future__ import annotations

from collections.abc import Callable

from .base import KVConnector
from .context import ConnectorContext

Factory = Callable[[ConnectorContext], KVConnector]
_FACTORIES: dict[str, Factory] = {}


def register(name: str, factory: Factory) -> None:
    if name in _FACTORIES:
        raise ValueError(f"a KV connector named {name!r} is registered already")
    _FACTORIES[name] = factory


def names() -> list[str]:
    _register_builtins()
    return sorted(_FACTORIES)


def build(ctx: ConnectorContext) -> list[KVConnector]:
    """The engine's connector stack; ValueError naming what does not fit."""
    _register_builtins()
    config = ctx.config
    wanted = config.kv_connector_names
    if not wanted:
        wanted = (["pd"] if ctx.receiver is not None else []) + (
            ["offload"] if config.kv_offload_enabled else [])
    if ctx.receiver is None and config.kv_role == "prefill":  # vLLM's kv_producer
        wanted = [n for n in wanted if n != "pd"]  # the served side: always on
    if ctx.receiver is not None and "pd" not in wanted:
        raise ValueError("kv_connector: a decode worker pulls its prompts' KV with the "
                         "'pd' connector, so it must be named")
    unknown = [n for n in wanted if n not in _FACTORIES]
    if unknown:
        raise ValueError(f"kv_connector: unknown connector {unknown[0]!r} (known: "
                         f"{', '.join(names())})")
    if len(set(wanted)) != len(wanted):
        raise ValueError(f"kv_connector: {config.kv_connector!r} names one twice")
    built: list[KVConnector] = []
    try:
        for n in wanted:
            built.append(_FACTORIES[n](ctx))
    except BaseException:
        for conn in built:  # their threads, their receiver
            conn.close()
        raise
    return built


def _pd(ctx: ConnectorContext) -> KVConnector:
    from .pd import PDConnector
    if ctx.receiver is None:
        raise ValueError("kv_connector 'pd' pulls a decode worker's KV: this engine has "
                         "no KV receiver (it is not a decode worker)")
    return PDConnector(ctx.receiver, ctx.config.block_size)


def _offload(ctx: ConnectorContext) -> KVConnector:
    from .offload import OffloadConnector
    return OffloadConnector.from_context(ctx)


def _register_builtins() -> None:
    if "pd" not in _FACTORIES:
        register("pd", _pd)
        register("offload", _offload)

"""The router process: the public Generation API over gRPC, and the OpenAI-compatible
HTTP API with /metrics beside it, both over the one request path (core.py)."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Sequence
from contextlib import aclosing
from pathlib import Path

import grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_grpc

from baton.services.common.message_size import request_bytes
from baton.services.common.tokenizer import Tokenizer
from baton.services.rpc import tracing
from baton.services.rpc.metrics import serve_metrics
from baton.services.rpc.security import Security
from baton.services.rpc.server import Lifecycle, method_name, run_server, service_name
from baton.v1 import generation_pb2 as gen
from baton.v1 import generation_pb2_grpc as gen_grpc

from . import vllm_wire, wire
from .clients import GrpcWorkerClient, WorkerClient
from .config import RouterConfig
from .core import Router
from .intake import Intake
from .lora.registry import RouterLoras
from .metrics import RouterMetrics
from .registry import Registry, Worker
from .reply import caller_of, write_within
from .vllm_engine import VllmEngineServicer

VLLM = "VllmEngine"  # vllm.grpc.engine.VllmEngine (vllm_engine.py)
# The methods that need an API key where the router has keys: every one of both APIs but
# VllmEngine's HealthCheck (as gRPC's own health service, for probes).
GENERATION_METHODS = (*(method_name(gen, "Generation", m)
                        for m in ("Generate", "Tokenize", "GetModelInfo",
                                  "LoadLoraAdapter", "UnloadLoraAdapter")),
                      *(method_name(vllm, VLLM, m.name)
                        for m in vllm.DESCRIPTOR.services_by_name[VLLM].methods
                        if m.name != "HealthCheck"))
# New work, refused while draining.
WORK_METHODS = (method_name(gen, "Generation", "Generate"), method_name(vllm, VLLM, "Generate"))


class RouterServicer(gen_grpc.GenerationServicer):
    """Generation over gRPC: protos in, protos out, the router's path in between."""

    def __init__(self, router: Router, security: Security | None = None):
        self.router = router
        self.security = security  # which API key a call brought (the interceptor checked it)

    async def Generate(self, request, context):
        """The request's stream, written to the client as it comes (a coroutine that
        writes: gRPC's own flow control holds each write while the client's window is
        full); a write held for --stream-stall-timeout cuts the stream, DEADLINE_EXCEEDED,
        and aborts the request everywhere."""
        caller = caller_of(context, self.security)
        stall = self.router.stream_stall_timeout
        async with aclosing(self.router.generate(request, caller)) as replies:
            async for reply in replies:
                await write_within(context, reply, stall)

    async def Tokenize(self, request, context):
        return gen.TokenizeResponse(token_ids=await self.router.tokenize(request))

    async def GetModelInfo(self, request, context):
        return gen.GetModelInfoResponse(info=self.router.model_info(),
                                        lora_adapters=self.router.loras.names())

    async def LoadLoraAdapter(self, request, context):
        info = self.router.model_info()
        await self.router.loras.load(self.router.registry, request.lora_name,
                                     request.lora_path, (info.served_model_name, info.model))
        return gen.LoadLoraAdapterResponse()

    async def UnloadLoraAdapter(self, request, context):
        await self.router.loras.unload(self.router.registry, request.lora_name)
        return gen.UnloadLoraAdapterResponse()


def build(config: RouterConfig, lifecycle: Lifecycle, prefill: Sequence[WorkerClient] = (),
          decode: Sequence[WorkerClient] = (),
          targets: dict | None = None, make_client=None, vllm_metrics: bool = True) -> Router:
    """The router over the given worker clients, and those its registry finds at
    `targets` (clients from `make_client(address)`), exporting vLLM's metric names for
    the whole request unless `vllm_metrics` is False (colocated: the engine's are the
    whole request already); the registry tells `lifecycle` when
    it can serve (NOT_SERVING until then), and its interceptor the size limits that
    Generate and Tokenize requests are counted against before protobuf parses them, both
    on the intake's parse threads (the event loop never parses a request); its server
    takes no message bigger than the largest request within them (gRPC refuses one)."""
    from baton.services.common.default_model import default_model_path
    from baton.services.common.generation_config import read_generation_config
    from baton.services.common.model_source import resolve_tokenizer

    registry = Registry([Worker(c.address, "prefill", c) for c in prefill],
                        [Worker(c.address, "decode", c) for c in decode],
                        poll_s=config.poll_interval, worker_timeout_s=config.worker_timeout,
                        on_ready=lambda ready, why: lifecycle.set_serving(ready),
                        policy=config.policy(), targets=targets or {},
                        make_client=make_client,
                        discovery_interval=config.discovery_interval,
                        discovery_grace=config.discovery_grace)
    model = config.model or default_model_path()
    source = resolve_tokenizer(config.tokenizer, model, config.revision,
                               config.tokenizer_revision)
    # The model's folder, where the workers read its defaults of unset sampling values:
    # the tokenizer's, unless --tokenizer names another.
    folder = source
    if config.tokenizer is not None and config.generation_config == "auto":
        folder = (Path(model) if Path(model).exists()
                  else resolve_tokenizer(None, model, config.revision))
    intake = Intake(Tokenizer(source, config.chat_template,
                              config.allow_special_tokens_in_content), limits=config.limits,
                    chat=config.chat_settings(), parses_per_key=config.max_parses_per_key,
                    unparsed_bytes=config.max_unparsed_bytes,
                    sampling_defaults=read_generation_config(config.generation_config,
                                                             folder)[1])

    def max_model_len() -> int | None:  # once a worker has said it
        info = registry.model_info()
        return info.max_model_len or None if info is not None else None

    lifecycle.max_receive_bytes = request_bytes(config.limits)
    lifecycle.request_checks.update({
        method_name(gen, "Generation", "Generate"): wire.check_generate(config.limits,
                                                                        max_model_len),
        method_name(gen, "Generation", "Tokenize"): wire.check_tokenize(config.limits),
        method_name(vllm, VLLM, "Generate"): vllm_wire.check_generate(config.limits,
                                                                      max_model_len)})
    lifecycle.parse_pool = intake.parse_pool
    metrics = RouterMetrics(config.served_model_name or "", vllm=vllm_metrics)
    metrics.set_slos(config.slo_ttft_ms, config.slo_itl_ms)
    metrics.watch_roles(registry)
    return Router(registry, intake, config.max_inflight, config.request_timeout,
                  metrics, config.served_model_name,
                  config.shared_prefix_cache,
                  RouterLoras(config.enable_lora, config.lora_modules,
                              config.allow_runtime_lora_updating, config.lora_root),
                  config.stream_stall_timeout)


def authorize(lifecycle: Lifecycle, router: Router, security: Security) -> None:
    """The interceptor's API-key check of the Generation methods, and the parse of a
    checked request in its key's turn, within the unparsed budget."""
    lifecycle.authorize = security.grpc_check(GENERATION_METHODS)
    lifecycle.parse = lambda metadata, load, raw: router.intake.parse_message(
        security.grpc_key_id(metadata) or "", load, raw)


def services(router: Router, security: Security | None):
    """What a router's server serves: Generation and VllmEngine over `router`."""
    def register(server: grpc.aio.Server) -> list[str]:
        gen_grpc.add_GenerationServicer_to_server(RouterServicer(router, security), server)
        vllm_grpc.add_VllmEngineServicer_to_server(VllmEngineServicer(router, security),
                                                   server)
        return [service_name(gen, "Generation"), service_name(vllm, VLLM)]

    return register


async def run(config: RouterConfig, router: Router, lifecycle: Lifecycle, idle=None,
              on_stop=None, registries=()) -> None:
    """Serve `router` over gRPC (and HTTP when config.http_port) until SIGTERM, drain,
    stop. The public port serves Generation and VllmEngine (with health and reflection),
    never a worker's services; `registries` adds metrics (a colocated worker's) to /metrics."""
    security = Security.of(config)
    if config.http_port:
        try:
            from .openai.server import HttpServer
        except ImportError as e:  # a router installed without the extra
            raise SystemExit(f"baton: the OpenAI-compatible API (--http-port "
                             f"{config.http_port}) needs `pip install baton[http]` "
                             f"({e.name} is missing); or pass --http-port 0") from None
    authorize(lifecycle, router, security)
    http = (HttpServer(config, router, security, lifecycle, registries) if config.http_port
            else None)

    register = services(router, security)

    async def start() -> None:
        if http is not None:
            await http.start()
        await router.registry.start()

    async def stop() -> None:
        if http is not None:
            await http.stop()
        await router.registry.close()
        router.intake.close()
        if on_stop is not None:
            await on_stop()
        tracing.shutdown()

    # Listening first (NOT_SERVING until the registry finds a worker to serve with).
    svc = config.service
    # What is loaded by now (modules, the tokenizer) lives as long as the process: a full
    # garbage collection never walks it again, so none pauses every stream for long.
    gc.freeze()
    serve_metrics(svc, [router.metrics.registry, *registries])
    await run_server(svc.address, register, lifecycle, idle=idle, on_start=start,
                     on_stop=stop, grace_s=svc.drain_grace, serving_at_start=False,
                     credentials=security.server_credentials(public=True),
                     max_calls=config.grpc_calls())


def serve(config: RouterConfig) -> None:
    """Run the router until SIGTERM, then drain its streams."""
    tracing.setup("baton-router", config.service)
    lifecycle = Lifecycle(WORK_METHODS)

    async def main():
        security = Security.of(config)
        targets = {role: config.targets(role) for role in ("prefill", "decode")}
        router = build(config, lifecycle, targets=targets,
                       make_client=lambda a: GrpcWorkerClient(a, security))
        await run(config, router, lifecycle)

    asyncio.run(main())

"""The colocated public port over gRPC (the rest of cluster auth:
tests/unit/test_cluster_auth.py)."""

from __future__ import annotations

import asyncio
import gc
import time

import grpc

from baton.cli import colocated
from baton.router import server as router_server
from baton.router.config import RouterConfig
from baton.services.engine.config import EngineConfig
from baton.services.rpc.server import make_server
from baton.services.worker.config import WorkerConfig
from baton.v1 import generation_pb2 as gen
from baton.v1 import generation_pb2_grpc as gen_grpc
from baton.worker.v1 import worker_pb2 as wk
from tests.unit.test_cluster_auth import KEY, _answer, _worker_methods


def test_the_colocated_public_port_serves_no_worker_rpc_to_a_key_holder(tiny_model,
                                                                         monkeypatch):
    # What the caller sent: replace everyone's `prod` at a version no router
    # reload could ever beat.
    takeover = wk.LoadLoraRequest(adapter=wk.LoraAdapter(
        name="prod", path=str(tiny_model), version=2**63 - 1)).SerializeToString()
    answers: dict[str, grpc.StatusCode] = {}

    async def probe(address, register, lifecycle, idle=None, on_stop=None, on_start=None,
                    **kw):
        """run_server's stand-in: the colocated server as it would listen, probed."""
        server = make_server(register, lifecycle)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        await on_start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                # The key is good: the public API serves it, once the engine is up.
                stub, deadline = gen_grpc.GenerationStub(channel), time.monotonic() + 60
                while True:
                    try:
                        await stub.GetModelInfo(gen.GetModelInfoRequest(), timeout=10,
                                                metadata=(("authorization", f"Bearer {KEY}"),))
                        break
                    except grpc.aio.AioRpcError as e:
                        assert e.code() == grpc.StatusCode.UNAVAILABLE and \
                            time.monotonic() < deadline, e
                        await asyncio.sleep(0.02)
                for method, streaming in _worker_methods():
                    request = takeover if method.endswith("/LoadLora") else b""
                    answers[method] = await _answer(channel, method, streaming, request)
        finally:
            await server.stop(0)
            await on_stop()

    monkeypatch.setattr(router_server, "run_server", probe)
    engine = EngineConfig(model=str(tiny_model), dtype="float32", kv_cache_gib=0.02,
                          max_num_seqs=4, max_num_batched_tokens=128, enable_lora=True)
    try:
        colocated.serve(WorkerConfig(engine=engine, engine_id="colocated-test"),
                        RouterConfig(model=str(tiny_model), http_port=0, api_keys=(KEY,),
                                     poll_interval=0.05, enable_lora=True))
    finally:
        gc.unfreeze()  # the router froze what this process holds
    assert len(answers) == len(_worker_methods()) > 10
    served = {m: c for m, c in answers.items() if c not in (
        grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.PERMISSION_DENIED)}
    assert not served, f"worker RPCs served on the public port: {served}"

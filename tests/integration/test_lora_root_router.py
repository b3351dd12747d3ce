"""Unreadable adapter paths through the router and fake workers (the LoRA root itself:
tests/unit/test_lora_root.py)."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from baton.services.lora.paths import UNREADABLE
from baton.v1 import generation_pb2 as gen
from baton.worker.v1 import worker_pb2 as wk
from tests import router_fakes
from tests.unit import test_lora_root

tree = test_lora_root.tree  # the fixture, shared


def test_every_unreadable_path_gets_one_answer_and_models_show_no_path(tok, tree,
                                                                       monkeypatch):
    """Over HTTP and gRPC, on fake workers that refuse "nowhere" as the engine does: the
    router's refusals and the worker's read the same; /v1/models names, never paths."""
    import httpx

    from baton.router.openai import app as app_module
    from baton.services.rpc.config import ServiceConfig
    from baton.services.rpc.security import Security
    from baton.services.rpc.server import Lifecycle

    root = tree[0]
    sent = []

    async def load_lora(self, request, context):
        sent.append(request.adapter.path)
        if request.adapter.path.endswith("nowhere"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, UNREADABLE)
        return wk.LoadLoraResponse()

    monkeypatch.setattr(router_fakes.FakeWorker, "LoadLora", load_lora, raising=False)

    async def main():
        async with router_fakes.cluster(tok, enable_lora=True, lora_root=str(root),
                                        allow_runtime_lora_updating=True) as c:
            await c.polled()
            app = app_module.make_app(c.router, Security(ServiceConfig()), Lifecycle())
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://t") as client:
                on_http, on_grpc = set(), set()
                for path in ("nowhere", "../outside/secret", "link_out"):
                    r = await client.post("/v1/load_lora_adapter",
                                          json={"lora_name": "x", "lora_path": path})
                    on_http.add((r.status_code, r.text))
                    with pytest.raises(grpc.RpcError) as e:
                        await c.stub.LoadLoraAdapter(gen.LoadLoraAdapterRequest(
                            lora_name="x", lora_path=path), timeout=10)
                    on_grpc.add((e.value.code(), e.value.details()))
                # Only "nowhere" reached the workers: the router refused the other two.
                assert sent and all(p.endswith("nowhere") for p in sent)
                [(status, body)], [(code, details)] = on_http, on_grpc
                assert status == 400 and code == grpc.StatusCode.INVALID_ARGUMENT
                error = json.loads(body)["error"]
                assert error["message"] == details == UNREADABLE
                assert error["param"] == "lora_path"
                r = await client.post("/v1/load_lora_adapter",
                                      json={"lora_name": "x", "lora_path": "good"})
                assert r.status_code == 200, r.text
                models = await client.get("/v1/models")
                cards = models.json()["data"]
                assert [(m["id"], m["root"]) for m in cards[1:]] == [("x", "x")]
                assert str(root.parent) not in models.text and "good" not in models.text
                info = await c.stub.GetModelInfo(gen.GetModelInfoRequest(), timeout=10)
                assert str(root.parent) not in str(info)

    asyncio.run(main())

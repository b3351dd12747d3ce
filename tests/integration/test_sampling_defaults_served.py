"""A served chat that gives no max_tokens takes the model's max_new_tokens
(tests/unit/test_sampling_defaults.py checks how the defaults resolve)."""

from __future__ import annotations

import asyncio

import httpx

from baton.router.openai import app as app_module
from baton.router.openai.protocol import ChatRequest
from baton.services.common.generation_config import read_generation_config
from baton.services.rpc.config import ServiceConfig
from baton.services.rpc.security import Security
from baton.services.rpc.server import Lifecycle
from tests.router_fakes import cluster
from tests.unit.test_sampling_defaults import MODEL, _folder


def test_a_chat_without_max_tokens_takes_the_models_max_new_tokens(tmp_path, tok):
    """As vLLM: the model's max_new_tokens, else until the context is full; a request's
    own max_tokens wins."""
    folder = _folder(tmp_path, MODEL)
    most = read_generation_config("auto", folder)[1]["max_tokens"]
    (unset,) = ChatRequest(model="m", messages=[{"role": "user", "content": "hi"}]
                           ).requests(2048, {"max_tokens": most})
    assert unset.sampling.max_tokens == most

    async def main():
        async with cluster(tok, generation_config=str(folder)) as c:
            app = app_module.make_app(c.router, Security(ServiceConfig(), ()), Lifecycle())
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://t") as client:
                async def chat(**kw):
                    r = await client.post("/v1/chat/completions", timeout=10, json={
                        "model": "fake", "messages": [{"role": "user", "content": "hi"}],
                        **kw})
                    assert r.status_code == 200, r.text
                    return r.json()["usage"]["completion_tokens"]

                assert await chat() == most
                assert await chat(max_tokens=3) == 3

    asyncio.run(main())

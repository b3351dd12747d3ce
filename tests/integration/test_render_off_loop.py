"""A whole response is rendered off the router's event loop, through fake workers (the
rendering itself: tests/unit/test_render.py)."""

from __future__ import annotations

import asyncio
import threading

import httpx

from baton.router.openai import app as app_module
from baton.router.openai.render import Renderer
from baton.services.rpc.config import ServiceConfig
from baton.services.rpc.security import Security
from baton.services.rpc.server import Lifecycle
from tests.router_fakes import PROMPT, cluster


def test_a_whole_response_is_rendered_off_the_event_loop(tok, monkeypatch):
    on_loop = []
    real = Renderer.logprobs

    def logprobs(self, *args):
        on_loop.append(threading.current_thread() is threading.main_thread())
        return real(self, *args)

    monkeypatch.setattr(Renderer, "logprobs", logprobs)

    async def main():
        async with cluster(tok, worker_timeout=60) as c:
            app = app_module.make_app(c.router, Security(ServiceConfig(), ()), Lifecycle())
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://t") as client:
                reply = await client.post("/v1/completions", json={
                    "model": "fake", "prompt": PROMPT, "max_tokens": 4, "logprobs": 2},
                    timeout=30)
        assert reply.status_code == 200, reply.text
        lp = reply.json()["choices"][0]["logprobs"]
        assert len(lp["tokens"]) == len(lp["top_logprobs"]) == 4
        assert all(len(top) == 2 for top in lp["top_logprobs"])

    asyncio.run(main())  # (the loop runs in the main thread)
    assert on_loop and not any(on_loop), on_loop

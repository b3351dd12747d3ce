"""--max-inflight over the fakes (router_fakes.py): Tokenize counts toward it, and an
OpenAI request's choices are admitted all at once, so a choice that starts after the
first token is never refused mid-stream."""

from __future__ import annotations

import asyncio
import json

import grpc
import httpx
import pytest

from baton.router.openai import app as app_module
from baton.services.rpc.config import ServiceConfig
from baton.services.rpc.security import Security
from baton.services.rpc.server import Lifecycle
from baton.v1 import generation_pb2 as gen
from tests.router_fakes import PROMPT, cluster, expected, request


async def _until(condition, timeout: float = 60.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition never held")


def test_tokenize_counts_toward_max_inflight(tok):
    async def main():
        # A frozen prefill worker holds the Generate's slot, never called down meanwhile
        # (after the fakes' 0.5 s the prompt would move on: on a slow machine, before
        # the refusal).
        async with cluster(tok, max_inflight=1, worker_timeout=60) as c:
            c.prefill[0].freeze()  # the Generate below holds its slot
            held = asyncio.ensure_future(c.generate(PROMPT, 4))
            await _until(lambda: c.router.inflight == 1)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await c.stub.Tokenize(gen.TokenizeRequest(text="hello"), timeout=5)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            c.prefill[0].thaw()
            await held
            ids = (await c.stub.Tokenize(gen.TokenizeRequest(text="hello"))).token_ids
            assert list(ids) and c.router.inflight == 0

    asyncio.run(main())


def test_all_choices_are_admitted_at_once_so_none_is_refused_mid_stream(tok):
    async def main():
        async with cluster(tok, max_inflight=2, worker_timeout=60) as c:  # as above
            c.decode[0].token_delay_s = 0.02  # the other request stays in flight a while
            app = app_module.make_app(c.router, Security(ServiceConfig(), ()), Lifecycle())
            c.prefill[0].freeze()  # choice 0 waits for its first token
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://t") as client:
                both = asyncio.ensure_future(client.post("/v1/completions", json={
                    "model": "fake", "prompt": PROMPT, "n": 2, "max_tokens": 4,
                    "stream": True}, timeout=10))
                await _until(lambda: c.router.inflight >= 1)
                other = asyncio.ensure_future(c.stub.Generate(request(PROMPT[1:], 4),
                                                              timeout=10).read())
                await _until(lambda: other.done() or c.router.inflight >= 2)
                c.prefill[0].thaw()
                reply = await both
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await other  # it came second: the two choices held both slots
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            events = [json.loads(line[6:]) for line in reply.text.splitlines()
                      if line.startswith("data: {")]
            assert not any("error" in ev for ev in events), events
            text = {0: "", 1: ""}
            for ev in events:
                for choice in ev["choices"]:
                    text[choice["index"]] += choice["text"]
            want = "".join(f"<{t}>" for t in expected(PROMPT, 4))
            assert text == {0: want, 1: want}
            await _until(lambda: c.router.inflight == 0)

    asyncio.run(main())

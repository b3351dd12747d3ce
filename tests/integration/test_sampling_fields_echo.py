"""echo and bad sampling fields through the router and fake workers (the fields' parsing:
tests/unit/test_sampling_fields_api.py)."""

from __future__ import annotations

import asyncio
import json

import grpc
import httpx
import pytest

from baton.router.openai import app as app_module
from baton.services.common.tokenizer import Tokenizer
from baton.services.rpc.config import ServiceConfig
from baton.services.rpc.security import Security
from baton.services.rpc.server import Lifecycle
from baton.v1 import generation_pb2 as gen
from tests.router_fakes import PROMPT, cluster, expected


def test_echo_puts_the_prompt_before_each_choice_and_bad_fields_are_400s(tok):
    tokenizer = Tokenizer(tok)
    prompt_text = tokenizer.decode(PROMPT)

    def fake_text(prompt: list[int]) -> str:
        return "".join(f"<{t}>" for t in expected(prompt, 3))

    want = fake_text(PROMPT)

    async def main():
        async with cluster(tok) as c:
            app = app_module.make_app(c.router, Security(ServiceConfig(), ()), Lifecycle())
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://t") as client:
                def post(path, **body):
                    return client.post(path, json={"model": "fake", **body}, timeout=10)

                texts = ["Hi there", "Bye now"]
                whole = await post("/v1/completions", prompt=texts, n=2, max_tokens=3,
                                   echo=True)
                assert whole.status_code == 200, whole.text
                assert [ch["text"] for ch in whole.json()["choices"]] == [
                    t + fake_text(tokenizer.encode(t)) for t in texts for _ in (0, 1)]
                ids = await post("/v1/completions", prompt=PROMPT, max_tokens=3, echo=True)
                assert ids.json()["choices"][0]["text"] == prompt_text + want
                streamed = await post("/v1/completions", prompt=PROMPT, max_tokens=3,
                                      echo=True, stream=True)
                events = [json.loads(line[6:]) for line in streamed.text.splitlines()
                          if line.startswith("data: {")]
                chunks = [ch["text"] for ev in events for ch in ev["choices"]]
                assert chunks[0].startswith(prompt_text) and "".join(chunks) == (
                    prompt_text + want)
                plain = await post("/v1/completions", prompt=PROMPT, max_tokens=3)
                assert plain.json()["choices"][0]["text"] == want
                for body, param in [
                    ({"max_tokens": 3, "min_tokens": 4}, "min_tokens"),
                    ({"max_tokens": 3, "logit_bias": {"49152": 1}}, "logit_bias"),
                    ({"max_tokens": 3, "logit_bias": {"5": 101}}, "logit_bias"),
                    ({"max_tokens": 3, "bad_words": [" "]}, "bad_words"),
                    ({"max_tokens": 3, "echo": True, "logprobs": 1}, "echo")]:
                    reply = await post("/v1/completions", prompt=PROMPT, **body)
                    assert reply.status_code == 400, (body, reply.text)
                    assert reply.json()["error"]["param"] == param, reply.json()
            def generate(**sampling):
                return c.stub.Generate(gen.GenerateRequest(
                    token_ids=gen.TokenIds(ids=PROMPT),
                    sampling=gen.SamplingParams(max_tokens=3, **sampling)), timeout=10)

            with pytest.raises(grpc.aio.AioRpcError) as e:
                await generate(min_tokens=4).read()
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "min_tokens (4) must be at most max_tokens (3)" in e.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await generate(logit_bias={49152: 1.0}).read()
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "logit_bias token id 49152 is outside" in e.value.details()
            ok = [m async for m in generate(min_tokens=3, logit_bias={7: -100.0},
                                            bad_words=["x"])]
            assert [t for m in ok for t in m.delta.token_ids] == expected(PROMPT, 3)

    asyncio.run(main())

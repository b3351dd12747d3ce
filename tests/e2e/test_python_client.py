"""baton_client against the session topology's router (the public API on real services):
the same greedy tokens as a direct stub call, sync and async, and bad arguments as
BatonError(INVALID_ARGUMENT)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from baton.v1 import generation_pb2 as gen
from baton.v1 import generation_pb2_grpc as gen_grpc
from baton_client import AsyncClient, BatonError, Client
from tests.e2e.helpers import greedy, joined, run
from tests.e2e.topology import channel

PROMPT = "The three primary colours are"
MESSAGES = [{"role": "user", "content": "Name three rivers of Europe."}]


def _direct(router: str, **prompt) -> tuple[list[int], str]:
    return joined(run(router, gen.GenerateRequest(sampling=greedy(16), **prompt)))


def test_sync_complete_equals_a_direct_stub_call(topology):
    router = topology["router"]
    want = _direct(router, text=PROMPT)
    with Client(router, timeout=120) as client:
        done = client.complete(PROMPT, max_tokens=16, temperature=0.0)
        ids = client.tokenize(PROMPT)
        info = client.model_info()
    assert want[0] and (list(done.token_ids), done.text) == want
    assert done.finish_reason in ("stop", "length") and done.request_id
    assert done.usage.completion_tokens == len(want[0]) and done.usage.prompt_tokens == len(ids)
    assert done.timings is not None
    with channel(router) as ch:
        stub = gen_grpc.GenerationStub(ch)
        assert list(ids) == list(stub.Tokenize(gen.TokenizeRequest(text=PROMPT),
                                               timeout=30).token_ids)
        direct = stub.GetModelInfo(gen.GetModelInfoRequest(), timeout=30).info
    assert (info.model, info.max_model_len, info.vocab_size) == (
        direct.model, direct.max_model_len, direct.vocab_size)


def test_async_stream_concatenates_to_the_same(topology):
    router = topology["router"]
    chat = gen.ChatMessages(messages=[gen.ChatMessage(**m) for m in MESSAGES])
    want_text, want_chat = _direct(router, text=PROMPT), _direct(router, chat=chat)

    async def main():
        async with AsyncClient(router, timeout=120) as client:
            text = [c async for c in client.generate(PROMPT, max_tokens=16, temperature=0)]
            chat = [c async for c in client.generate(messages=MESSAGES, max_tokens=16,
                                                     temperature=0)]
            return text, chat

    for chunks, want in zip(asyncio.run(main()), (want_text, want_chat), strict=True):
        assert ([t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks)) \
            == want
        assert chunks[-1].finish_reason in ("stop", "length") and chunks[-1].usage
        assert all(c.finish_reason is None for c in chunks[:-1])


@pytest.mark.parametrize("bad", [{"max_tokens": 0}, {"temperature": -1.0},
                                 {"logprobs": 21}, {"token_ids": [10**8]}])
def test_bad_arguments_are_invalid_argument(topology, bad):
    prompt = None if "token_ids" in bad else PROMPT
    with Client(topology["router"], timeout=30) as client:
        with pytest.raises(BatonError) as e:
            client.complete(prompt, **{"max_tokens": 4, **bad})
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT, e.value
    assert e.value.retry_after_s is None and e.value.details

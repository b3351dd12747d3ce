"""baton_client against a scripted server on loopback: typed chunks, the retry hint,
no retry once a token arrived, deadlines, the API key; the sync and the async client
alike. And `import baton_client` loads nothing beyond grpc, protobuf and the stubs."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from contextlib import aclosing
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

import baton_client.aio
import baton_client.sync
from baton.v1 import generation_pb2 as gen
from baton_client import (
    AsyncClient,
    BatonError,
    Chunk,
    Client,
    Completion,
    ModelInfo,
    Timings,
    Usage,
    generate_request,
)
from baton_client.request import SAMPLING_FIELDS
from tests.integration.client_fakes import Step, fake_server, overloaded, response

ROOT = Path(__file__).resolve().parents[2]
KINDS = ["sync", "async"]


def _lp(*pairs) -> gen.TokenLogprobs:
    return gen.TokenLogprobs(entries=[gen.Logprob(token_id=t, logprob=p) for t, p in pairs])


SCRIPT = [
    response("Hello", [10, 11], logprobs=[_lp((10, -0.5)), _lp((11, -0.25), (12, -1.5))],
             timings=gen.Timings(queue_s=0.5, prefill_s=0.25, first_token_s=1.0)),
    response(" wor", [12], logprobs=[_lp((12, -2.0))]),
    response("ld!", [13], logprobs=[_lp((13, -0.125))], finish=gen.FINISH_REASON_STOP,
             stop_string="!", usage=gen.Usage(prompt_tokens=5, completion_tokens=4,
                                              cached_tokens=1),
             timings=gen.Timings(queue_s=0.5, prefill_s=0.25, kv_transfer_s=0.125,
                                 first_token_s=1.0, expected_cached_blocks=3,
                                 local_prefill=True)),
]
EXPECTED = [
    Chunk("r1", "Hello", (10, 11), logprobs=({10: -0.5}, {11: -0.25, 12: -1.5}),
          timings=Timings(0.5, 0.25, 0.0, 1.0)),
    Chunk("r1", " wor", (12,), logprobs=({12: -2.0},)),
    Chunk("r1", "ld!", (13,), "stop", "!", ({13: -0.125},), Usage(5, 4, 1),
          Timings(0.5, 0.25, 0.125, 1.0, 3, True)),
]
COMPLETION = Completion("r1", "Hello world!", (10, 11, 12, 13), "stop", "!",
                        ({10: -0.5}, {11: -0.25, 12: -1.5}, {12: -2.0}, {13: -0.125}),
                        Usage(5, 4, 1), Timings(0.5, 0.25, 0.125, 1.0, 3, True))


def stream(kind: str, address: str, prompt="hi", client=None, **kw):
    """(the chunks a generate() call yielded, the BatonError it ended with or None)."""
    chunks = []
    try:
        if kind == "sync":
            with Client(address, **(client or {})) as c:
                chunks.extend(c.generate(prompt, **kw))
        else:
            async def main():
                async with AsyncClient(address, **(client or {})) as c:
                    async for chunk in c.generate(prompt, **kw):
                        chunks.append(chunk)
            asyncio.run(main())
    except BatonError as e:
        return chunks, e
    return chunks, None


def call(kind: str, address: str, method: str, *args, client=None, **kw):
    """`method` of a client of `kind`, with its result returned (awaited if async)."""
    if kind == "sync":
        with Client(address, **(client or {})) as c:
            return getattr(c, method)(*args, **kw)

    async def main():
        async with AsyncClient(address, **(client or {})) as c:
            return await getattr(c, method)(*args, **kw)
    return asyncio.run(main())


@pytest.mark.parametrize("kind", KINDS)
def test_chunks_are_the_scripted_deltas_and_complete_joins_them(kind):
    with fake_server() as (address, fake):
        fake.script = [Step(responses=SCRIPT)]
        chunks, error = stream(kind, address, max_tokens=4, temperature=0.0, stop="!",
                               logprobs=1)
        assert error is None and chunks == EXPECTED
        sent = fake.calls[0].request
        assert sent.text == "hi" and sent.sampling.stop == ["!"]
        assert sent.sampling.HasField("temperature") and sent.sampling.temperature == 0.0
        assert not sent.sampling.HasField("top_p")  # unset: the server's default
        assert call(kind, address, "complete", "hi", max_tokens=4) == COMPLETION


@pytest.fixture
def sleeps(monkeypatch) -> list[float]:
    """The clients' sleeps before a retry (seconds), each slept as ever."""
    slept: list[float] = []

    def sync_sleep(seconds: float) -> None:
        slept.append(seconds)
        time.sleep(seconds)

    async def aio_sleep(seconds: float) -> None:
        slept.append(seconds)
        await asyncio.sleep(seconds)

    monkeypatch.setattr(baton_client.sync, "time", SimpleNamespace(sleep=sync_sleep))
    monkeypatch.setattr(baton_client.aio, "asyncio", SimpleNamespace(sleep=aio_sleep))
    return slept


@pytest.mark.parametrize("kind", KINDS)
def test_overloaded_is_retried_after_the_hint(kind, sleeps):
    with fake_server() as (address, fake):
        fake.script = [overloaded(50), overloaded(50), Step(responses=SCRIPT)]
        chunks, error = stream(kind, address, client={"max_retries": 3})
        assert error is None and chunks == EXPECTED
        assert len(fake.calls) == 3
        # The hint, plus up to 20% of it at random, before each retry.
        assert len(sleeps) == 2 and all(0.05 <= s <= 0.06 for s in sleeps), sleeps
    with fake_server() as (address, fake):
        fake.script = [overloaded(50), overloaded(50), Step(responses=SCRIPT)]
        chunks, error = stream(kind, address, client={"max_retries": 1})
        assert chunks == [] and len(fake.calls) == 2
        assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert error.retry_after_s == 0.05 and error.details == "queue full"


@pytest.mark.parametrize("kind", KINDS)
def test_no_retry_that_would_pass_the_deadline(kind, sleeps):
    with fake_server() as (address, fake):
        fake.script = [overloaded(5000), Step(responses=SCRIPT)]
        _, error = stream(kind, address, timeout=1.0)
        assert sleeps == [] and len(fake.calls) == 1  # it fails at once
        assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED and error.retry_after_s == 5.0


@pytest.mark.parametrize("kind", KINDS)
def test_no_retry_once_a_token_arrived(kind):
    unavailable = Step(responses=SCRIPT[:1], error=grpc.StatusCode.UNAVAILABLE,
                       details="worker died", trailing=(("retry-after-ms", "10"),))
    with fake_server() as (address, fake):
        fake.script = [unavailable, Step(responses=SCRIPT)]
        chunks, error = stream(kind, address)
        assert chunks == EXPECTED[:1] and len(fake.calls) == 1
        assert error.code == grpc.StatusCode.UNAVAILABLE and error.details == "worker died"
        fake.calls.clear()
        with pytest.raises(BatonError) as e:
            call(kind, address, "complete", "hi")
        assert e.value.code == grpc.StatusCode.UNAVAILABLE and len(fake.calls) == 1


def _carried(fake, start: float, timeout: float) -> None:
    """The last call carried the deadline `timeout` seconds after `start` (the client's
    own clock reading comes after it; the way over only makes the server's later; gRPC
    rounds a timeout up on the wire, by a percent or so)."""
    c = fake.calls[-1]
    assert c.remaining is not None and 0 < c.remaining <= 1.05 * timeout, c.remaining
    assert c.at + c.remaining >= start + timeout - 0.01, (c.at + c.remaining, start)


@pytest.mark.parametrize("kind", KINDS)
def test_deadline_exceeded_within_the_timeout(kind):
    """The hang would last 10 s and then end without an error: DEADLINE_EXCEEDED is the
    timeout's, which the call carried."""
    with fake_server() as (address, fake):
        fake.script = [Step(hang=True)]
        start = time.monotonic()
        _, error = stream(kind, address, timeout=1.0)
        assert error.code == grpc.StatusCode.DEADLINE_EXCEEDED and len(fake.calls) == 1
        _carried(fake, start, 1.0)
        fake.hang_unary = True  # the client's default deadline applies to every call
        start = time.monotonic()
        with pytest.raises(BatonError) as e:
            call(kind, address, "model_info", client={"timeout": 1.0})
        assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and len(fake.calls) == 2
        _carried(fake, start, 1.0)


@pytest.mark.parametrize("kind", KINDS)
def test_api_key_goes_as_bearer_metadata(kind):
    with fake_server() as (address, fake):
        fake.script = [Step(responses=SCRIPT)]
        key = {"api_key": "sekret"}
        call(kind, address, "complete", "hi", client=key)
        assert call(kind, address, "tokenize", "ab", client=key) == (97, 98)
        assert call(kind, address, "model_info", client=key) == ModelInfo(
            "fake", 2048, 100, (2,), 16, "float32", "LlamaForCausalLM", "llama", "fake-model")
        call(kind, address, "complete", "hi")
        assert [c.metadata.get("authorization") for c in fake.calls] == [
            "Bearer sekret"] * 3 + [None]


def test_leaving_a_stream_early_cancels_it():
    with fake_server() as (address, fake):
        fake.script = [Step(responses=SCRIPT[:1], hang=True)]
        with Client(address) as c:
            for _ in c.generate("hi"):
                break
            assert fake.gone.wait(30)
        fake.gone.clear()

        async def main():
            async with AsyncClient(address) as c:
                async with aclosing(c.generate("hi")) as chunks:
                    async for _ in chunks:
                        break
                await asyncio.sleep(0)
        asyncio.run(main())
        assert fake.gone.wait(30)


def test_every_sampling_field_is_a_keyword():
    values = dict(max_tokens=7, temperature=0.5, top_k=3, top_p=0.75, min_p=0.125, seed=42,
                  repetition_penalty=1.5, presence_penalty=0.25, frequency_penalty=0.5,
                  stop=["a", "b"], stop_token_ids=[5], ignore_eos=True, logprobs=2,
                  skip_special_tokens=False, include_stop_str_in_output=True,
                  structured_output=gen.StructuredOutput(regex="[ab]+"), min_tokens=4,
                  logit_bias={7: -100.0, 9: 2.5}, bad_words=["x y", "z"])
    assert set(values) == SAMPLING_FIELDS
    msg = generate_request(token_ids=[1, 2], request_id="x", priority=3, cache_salt="s",
                           **values)
    for name, value in values.items():
        assert getattr(msg.sampling, name) == value, name
    assert msg.sampling.HasField("skip_special_tokens")
    assert (msg.token_ids.ids, msg.request_id, msg.priority, msg.cache_salt) == (
        [1, 2], "x", 3, "s")
    chat = generate_request(messages=[{"role": "user", "content": "hi"}, ("system", "be")])
    assert [(m.role, m.content) for m in chat.chat.messages] == [("user", "hi"),
                                                                 ("system", "be")]


def test_bad_arguments_are_type_errors_before_any_call():
    with Client("127.0.0.1:1") as c:
        with pytest.raises(TypeError):
            c.generate("hi", max_token=3)
        with pytest.raises(TypeError):
            c.complete("hi", token_ids=[1])
        with pytest.raises(TypeError):
            c.generate()

    async def main():
        async with AsyncClient("127.0.0.1:1") as c:
            with pytest.raises(TypeError):
                c.generate("hi", temprature=0)
            with pytest.raises(TypeError):
                await c.complete("hi", nope=1)
    asyncio.run(main())


def test_import_loads_only_grpc_protobuf_and_the_stubs():
    code = (
        "import sys\n"
        "import grpc, grpc.aio, google.protobuf  # the dependencies, with what they load\n"
        "deps = set(sys.modules)\n"
        "import baton_client\n"
        "tops = {m.split('.')[0] for m in set(sys.modules) - deps}\n"
        "ours = {'grpc', 'google', 'baton', 'baton_client'}\n"
        "extra = tops - set(sys.stdlib_module_names) - ours\n"
        "assert not extra, extra\n"
        "loaded = {m.split('.')[0] for m in sys.modules}\n"
        "bad = {'torch', 'transformers', 'numpy', 'services', 'router', 'cli'} & loaded\n"
        "assert not bad, bad\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "protos")]))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env=env)

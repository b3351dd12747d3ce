"""The OpenAI-compatible HTTP API of the session topology's router, with the official
`openai` client (streaming and not, chat and completions) and raw HTTP for the error
shapes. The text must equal the gRPC API's for the same greedy request."""

from __future__ import annotations

import signal
import time

import httpx
import openai
import pytest

from baton.services.engine import SamplingParams
from baton.services.rpc.processes import wait_healthy
from baton.v1 import generation_pb2 as gen
from tests.e2e.helpers import greedy, joined, metric_value, run, stats

MESSAGES = [{"role": "user", "content": "Name three rivers of Europe."}]
PROMPT = "The three largest cities of Italy are"


@pytest.fixture(scope="module")
def http(topology):
    return "http://" + topology["topology"].http[topology["router"]]


@pytest.fixture(scope="module")
def client(http):
    return openai.OpenAI(base_url=http + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client):
    [m] = client.models.list().data
    return m.id


def _grpc_chat(router: str, n: int) -> tuple[list[int], str]:
    chat = gen.ChatMessages(messages=[gen.ChatMessage(**m) for m in MESSAGES])
    return joined(run(router, gen.GenerateRequest(chat=chat, sampling=greedy(n))))


def test_streamed_chat_equals_the_grpc_api(topology, client, model):
    want = _grpc_chat(topology["router"], 24)[1]
    stream = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=24,
                                            temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_whole_chat_and_completion_equal_the_grpc_api(topology, client, model, offline):
    ids, want = _grpc_chat(topology["router"], 16)
    out = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=16,
                                         temperature=0)
    assert out.choices[0].message.content == want
    assert out.usage.completion_tokens == len(ids)
    ref = offline.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0.0))[0]
    done = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    assert done.choices[0].text == ref.text
    assert done.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert done.choices[0].finish_reason == ref.finish_reason


def test_streamed_completion_reports_usage_with_cached_tokens(client, model):
    prompt = "A long shared system prompt that a second request will find cached. " * 6
    for _ in range(2):
        chunks = list(client.completions.create(
            model=model, prompt=prompt, max_tokens=8, temperature=0, stream=True,
            stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == 8
    assert usage.prompt_tokens_details.cached_tokens >= 64  # the second saw the first's KV
    assert all(c.usage is None for c in chunks[:-1])


def test_n_choices_share_one_prompt(topology, client, model):
    prompt = "Choices share the prompt's KV: it is computed once for all of them. " * 5
    before = stats(topology["prefill"])
    out = client.completions.create(model=model, prompt=prompt, max_tokens=6, n=3,
                                    temperature=0.8, seed=7)
    after = stats(topology["prefill"])
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    n_prompt = out.usage.prompt_tokens
    assert out.usage.completion_tokens == 18
    computed = after.num_prompt_tokens - before.num_prompt_tokens
    assert computed < n_prompt + 2 * 16  # the others only redo the last, partial block
    again = client.completions.create(model=model, prompt=prompt, max_tokens=6, n=3,
                                      temperature=0.8, seed=7)
    assert [c.text for c in again.choices] == [c.text for c in out.choices]  # seeded


def test_logprobs_in_both_shapes(client, model):
    out = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4,
                                         temperature=0, logprobs=True, top_logprobs=3)
    items = out.choices[0].logprobs.content
    assert len(items) == 4 and all(len(i.top_logprobs) == 3 for i in items)
    for item in items:  # greedy: the sampled token is the most likely one
        assert item.logprob == pytest.approx(max(t.logprob for t in item.top_logprobs))
        assert item.token == item.top_logprobs[0].token
    done = client.completions.create(model=model, prompt=PROMPT, max_tokens=3,
                                     temperature=0, logprobs=2)
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 3 and all(
        len(t) == 2 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == done.choices[0].text
    assert lp.text_offset == [len("".join(lp.tokens[:k])) for k in range(3)]


def test_min_tokens_logit_bias_bad_words_and_echo(client, model, offline):
    eos = offline.engine.model_info.eos_token_ids[0]
    # EOS pushed to the top: it comes first, or right after min_tokens tokens (the decode
    # worker counts the token the prefill worker sampled).
    for m in (0, 5):
        out = client.completions.create(model=model, prompt=PROMPT, max_tokens=20,
                                        temperature=0, logit_bias={str(eos): 100},
                                        extra_body={"min_tokens": m})
        assert out.usage.completion_tokens == m + 1, m
        assert out.choices[0].finish_reason == "stop"
    ref = offline.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0))[0]
    word = offline.tokenizer.decode(ref.token_ids[2:3])
    want = offline.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0,
                                                     bad_words=[word]))[0]
    assert want.token_ids != ref.token_ids
    for stream in (False, True):
        out = client.completions.create(model=model, prompt=PROMPT, max_tokens=8,
                                        temperature=0, echo=True, stream=stream,
                                        extra_body={"bad_words": [word]})
        text = "".join(c.choices[0].text for c in out) if stream else out.choices[0].text
        assert text == PROMPT + want.text


@pytest.mark.parametrize("body, status, param", [
    ({"messages": MESSAGES, "temperature": -1}, 400, "temperature"),
    ({"messages": MESSAGES, "max_tokens": 0}, 400, "max_tokens"),
    ({"temperature": 0}, 400, "messages"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ({"messages": MESSAGES, "logit_bias": {"49152": 5}}, 400, "logit_bias"),  # no such id
    ({"messages": MESSAGES, "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens"),
    ({"messages": MESSAGES, "model": "gpt-9"}, 404, "model"),
    ({"messages": MESSAGES, "max_tokens": 2**40}, 400, None),  # past int32: still a 400
])
def test_errors_in_openais_shape(http, model, body, status, param):
    body = {"model": model, **body}
    r = httpx.post(http + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["type"] == (
        "invalid_request_error" if status == 400 else "not_found_error")


def test_models_health_and_metrics_that_move(topology, http, client, model):
    assert httpx.get(http + "/health", timeout=10).status_code == 200
    before = httpx.get(http + "/metrics", timeout=10).text
    client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0)
    after = httpx.get(http + "/metrics", timeout=10).text
    for name in ("baton:time_to_first_token_seconds_count",
                 "baton:e2e_request_latency_seconds_count",
                 "baton:request_generation_tokens_count",
                 # vLLM's names at the front door, for the whole disaggregated request
                 "vllm:time_to_first_token_seconds_count",
                 "vllm:e2e_request_latency_seconds_count", "vllm:request_success_total",
                 "vllm:generation_tokens_total"):
        assert metric_value(after, name) > metric_value(before, name), name
    assert "vllm:num_requests_running{" in after and "vllm:num_requests_waiting{" in after
    for role in ("prefill", "decode"):
        text = httpx.get(f"http://{topology['topology'].metrics[topology[role]]}/metrics",
                         timeout=10).text
        assert "baton:kv_cache_usage_perc{" in text
        assert 0 <= metric_value(text, "baton:kv_cache_usage_perc") <= 1
        assert metric_value(text, "baton:generation_tokens_total") > 0


def test_a_client_that_disconnects_frees_every_block(topology, http, model):
    """Whatever the machine's speed: a request left is ended on the workers (fewer tokens
    than asked were generated), not merely finished by the time of the check."""
    from tests.e2e.conftest import both_free_within

    topo, prefill, decode = topology["topology"], topology["prefill"], topology["decode"]
    generated = stats(decode).num_generation_tokens
    body = {"model": model, "prompt": "Write a very long story.", "max_tokens": 4000,
            "ignore_eos": True, "stream": True}  # 10 s of decoding
    with httpx.stream("POST", http + "/v1/completions", json=body, timeout=60) as r:
        for n, _ in enumerate(r.iter_lines()):
            if n == 4:
                break
        else:
            pytest.fail("the stream ended before the client left")
    assert both_free_within(topology, 20.0)  # well before a lease could expire (30 s)
    assert stats(decode).num_generation_tokens - generated < 4000
    # Whole (not streamed), and gone before the first token: the prompt is long, n is 2,
    # and the prefill worker is paused until the client has left.
    body = {"model": model, "prompt": "Tell a story. " * 1000, "max_tokens": 400, "n": 2,
            "ignore_eos": True}
    generated = stats(decode).num_generation_tokens
    topo.kill(prefill, signal.SIGSTOP)
    try:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(http + "/v1/completions", json=body, timeout=0.5)
        deadline = time.monotonic() + 60
        while metric_value(httpx.get(http + "/metrics", timeout=10).text,
                           "baton:num_requests_in_flight") > 0:
            assert time.monotonic() < deadline, "the router kept the request"
            time.sleep(0.02)
    finally:
        topo.kill(prefill, signal.SIGCONT)
    assert both_free_within(topology, 20.0)
    assert stats(decode).num_generation_tokens == generated  # neither choice got there
    router = topology["router"]
    wait_healthy(router, topo.process(router), timeout=60)  # had it called the worker down


@pytest.fixture(scope="module")
def strict(topology):
    """A second router on the same workers: one request at a time, a short timeout (and a
    minute before it calls a silent worker down: its request timeout decides)."""
    topo = topology["topology"]
    address = topo.start("router", "--prefill", topology["prefill"], "--decode",
                         topology["decode"], "--max-inflight", "1", "--request-timeout", "3",
                         "--worker-timeout", "60")
    return "http://" + topo.http[address]


def test_429_with_retry_after_and_504_past_the_deadline(topology, strict, model):
    long = {"model": model, "prompt": "Write a very long story.", "max_tokens": 4000,
            "ignore_eos": True}  # 10 s of decoding, past the 3 s timeout
    with httpx.Client(timeout=30) as c, httpx.Client(timeout=30) as c2:
        with c.stream("POST", strict + "/v1/completions", json={**long, "stream": True}) as r:
            lines = r.iter_lines()
            next(lines)  # it holds the router's one slot now (while `lines` lives)
            busy = c2.post(strict + "/v1/completions", json={**long, "max_tokens": 2})
            assert busy.status_code == 429 and int(busy.headers["retry-after"]) >= 1
            assert busy.json()["error"]["type"] == "rate_limit_error"
    many = httpx.post(strict + "/v1/completions", json={**long, "n": 2}, timeout=30)
    assert many.status_code == 400 and many.json()["error"]["param"] == "n"
    # The decode worker paused: the request cannot end before its timeout, however fast.
    topo, decode = topology["topology"], topology["decode"]
    topo.kill(decode, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        late = httpx.post(strict + "/v1/completions", json=long, timeout=60)
        took = time.monotonic() - t0
    finally:
        topo.kill(decode, signal.SIGCONT)
    assert late.status_code == 504, late.text
    assert took < 30  # at the 3 s timeout: ten times that
    router = topology["router"]
    wait_healthy(router, topo.process(router), timeout=60)  # had it called the worker down


def test_503_when_no_worker_can_serve(topology, model):
    topo = topology["topology"]
    from tests.e2e.topology import free_port

    address = topo.start("router", "--decode", f"127.0.0.1:{free_port()}", healthy=False)
    http = "http://" + topo.http[address]
    deadline = time.monotonic() + 30
    while True:
        try:
            r = httpx.post(http + "/v1/completions", json={"model": model, "prompt": "hi"},
                           timeout=10)
            break
        except httpx.TransportError:
            assert time.monotonic() < deadline
            time.sleep(0.2)
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable_error"
    assert httpx.get(http + "/health", timeout=10).status_code == 503

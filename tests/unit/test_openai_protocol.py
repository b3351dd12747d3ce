"""The OpenAI layer's own rules, without a model: what each field becomes, what is
refused, the HTTP guard (body size, key, drain), and a Grafana dashboard that reads only
metrics the services export."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import httpx
import pytest

from baton.router.metrics import RouterMetrics
from baton.router.openai import app as app_module
from baton.router.openai.protocol import ChatRequest, CompletionRequest
from baton.router.openai.render import param_of
from baton.services.engine.outputs import EngineStats
from baton.services.rpc.config import ServiceConfig
from baton.services.rpc.convert import sampling_params
from baton.services.rpc.errors import InvalidArgument
from baton.services.rpc.security import Security
from baton.services.rpc.server import Lifecycle
from baton.services.worker.metrics import WorkerMetrics

ROOT = Path(__file__).resolve().parents[2]
MESSAGES = [{"role": "user", "content": "hi"}]


def test_chat_fields_map_to_sampling_and_choices_get_their_own_seeds():
    body = ChatRequest(model="m", messages=MESSAGES, max_completion_tokens=7, max_tokens=99,
                       temperature=0.5, top_p=0.9, stop="END", n=3, seed=10, logprobs=True,
                       top_logprobs=2, presence_penalty=0.1, top_k=5, min_p=0.05,
                       repetition_penalty=1.1, priority=-1, user="u")
    reqs = body.requests(max_model_len=2048)
    assert len(reqs) == 3 and [r.sampling.seed for r in reqs] == [10, 11, 12]
    s = reqs[0].sampling
    assert (s.max_tokens, round(s.temperature, 3), round(s.top_p, 3), list(s.stop),
            s.logprobs, s.top_k, reqs[0].priority) == (
        7, 0.5, 0.9, ["END"], 2, 5, -1)
    assert [m.role for m in reqs[0].chat.messages] == ["user"]
    unset = ChatRequest(model="m", messages=MESSAGES).requests(max_model_len=2048)[0]
    assert unset.sampling.max_tokens == 2048  # until the context is full, as OpenAI
    assert not unset.sampling.HasField("logprobs")


def test_completion_prompts_in_every_form_make_one_request_per_prompt_and_choice():
    for prompt, kinds in [("text", ["text"]), ([1, 2, 3], ["token_ids"]),
                          (["a", "b"], ["text", "text"]), ([[1], [2, 3]], ["token_ids"] * 2)]:
        reqs = CompletionRequest(model="m", prompt=prompt, n=2).requests(2048)
        assert [r.WhichOneof("prompt") for r in reqs] == [k for k in kinds for _ in (0, 1)]
        assert all(r.sampling.max_tokens == 16 for r in reqs)  # OpenAI's default


@pytest.mark.parametrize("body, field", [
    ({"logit_bias": {"a1": 2.0}}, "logit_bias"),
    ({"logit_bias": {"-1": 2.0}}, "logit_bias"),
    ({"functions": [{"name": "f"}]}, "functions"),  # OpenAI's old form: unknown
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0]"),
])
def test_what_the_engine_cannot_honour_is_refused_naming_it(body, field):
    with pytest.raises(InvalidArgument, match=re.escape(field)):
        ChatRequest(model="m", **{"messages": MESSAGES, **body}).requests(2048)


def test_echo_with_logprobs_suffix_and_best_of_are_refused():
    for extra in ({"echo": True, "logprobs": 1}, {"suffix": "x"}, {"best_of": 3}):
        with pytest.raises(InvalidArgument, match=next(iter(extra))):
            CompletionRequest(model="m", prompt="p", **extra).requests(2048)


def test_min_tokens_logit_bias_and_bad_words_reach_the_wire_and_the_engine():
    body = {"messages": MESSAGES, "max_tokens": 9, "min_tokens": 4,
            "logit_bias": {"7": -100, " 12": 2.5}, "bad_words": ["no way", "x"]}
    msg = ChatRequest(model="m", **body).requests(2048)[0].sampling
    assert (msg.min_tokens, dict(msg.logit_bias), list(msg.bad_words)) == (
        4, {7: -100.0, 12: 2.5}, ["no way", "x"])
    params = sampling_params(msg)
    assert (params.min_tokens, params.logit_bias, params.bad_words) == (
        4, ((7, -100.0), (12, 2.5)), ("no way", "x"))
    unset = sampling_params(ChatRequest(model="m", messages=MESSAGES).requests(2048)[0]
                            .sampling)
    assert (unset.min_tokens, unset.logit_bias, unset.bad_words) == (0, (), ())


def test_echo_texts_follow_the_requests_order():
    decode = lambda ids: "|".join(map(str, ids))  # noqa: E731
    for prompt, want in [("a b", ["a b"] * 2), ([1, 2], ["1|2"] * 2),
                         (["x", "y"], ["x", "x", "y", "y"]),
                         ([[1], [2, 3]], ["1", "1", "2|3", "2|3"])]:
        body = CompletionRequest(model="m", prompt=prompt, n=2, echo=True)
        assert len(body.requests(2048)) == len(want)
        assert body.echo_texts(decode) == want
    assert CompletionRequest(model="m", prompt="p").echo_texts(decode) == []


@pytest.mark.parametrize("message, chat, param", [
    ("sampling: temperature must be >= 0, got -1.0", True, "temperature"),
    ("chat.messages[1].role: 'robot' is not one of ...", True, "messages[1].role"),
    ("text: 9999999 characters cannot fit", False, "prompt"),
    ("prompt: 4000 tokens; max_model_len is 2048", True, "messages"),
])
def test_errors_name_the_openai_field(message, chat, param):
    assert param_of(message, chat) == param


def _guarded(limit: int, keys=(), draining=False):
    async def inner(scope, receive, send):
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    state = Lifecycle()
    state.draining = draining
    guard = app_module.Guard(inner, Security(ServiceConfig(), tuple(keys)), state)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=guard), base_url="http://t")


def test_the_guard_refuses_big_bodies_strangers_and_new_work_while_draining(monkeypatch):
    monkeypatch.setattr(app_module, "MAX_BODY_BYTES", 100)

    async def main():
        async with _guarded(100) as c:
            assert (await c.post("/v1/completions", content=b"x" * 50)).status_code == 200
            big = await c.post("/v1/completions", content=b"x" * 101)
            assert big.status_code == 413 and big.json()["error"]["message"]
        async with _guarded(100, keys=["k"]) as c:
            assert (await c.post("/v1/completions", content=b"{}")).status_code == 401
            ok = await c.post("/v1/completions", content=b"{}",
                              headers={"Authorization": "Bearer k"})
            assert ok.status_code == 200
            assert (await c.get("/health")).status_code == 200  # open without a key
        async with _guarded(100, draining=True) as c:
            assert (await c.post("/v1/completions", content=b"{}")).status_code == 503

    asyncio.run(main())


def test_the_grafana_dashboard_reads_only_metrics_the_services_export():
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "baton.json").read_text())
    exported = set()
    worker = WorkerMetrics(lambda: EngineStats(num_blocks=10, num_free_blocks=10), "m", 1)
    for registry in (RouterMetrics("m").registry, worker.registry):
        for family in registry.collect():
            suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"),
                        "gauge": ("",)}[family.type]
            exported |= {family.name + suffix for suffix in suffixes}
    used = {name for panel in dashboard["panels"] for t in panel["targets"]
            for name in re.findall(r"baton:[a-z0-9_]+", t["expr"])}
    assert len(dashboard["panels"]) >= 10 and used
    assert used <= exported, used - exported

"""The real Shepherd Model Gateway (`smg`, its vLLM gRPC backend) in front of Baton's
VllmEngine API, on the default model: behind it, a colocated server and a router over a
prefill and a decode worker (the session's `smollm` services). Through the gateway,
OpenAI chat and completions requests, streamed and not, answer what Baton's own OpenAI
API answers for them; a request Baton refuses gets the gateway's error with Baton's
message; a client that leaves mid-stream leaves no block held on any worker."""

from __future__ import annotations

import json

import httpx
import pytest

from baton.tools.bench.smg_gateway import gateway
from tests.e2e.helpers import all_free_within, colocated_http

# (path, body, streamed, in front of the P/D router too): chat and completions, each
# streamed and not, with stop strings the greedy output reaches, max_tokens and logprobs.
CASES = [
    ("chat/completions", {"messages": [{"role": "user", "content": "Name three colors."}],
                          "max_tokens": 12}, False, False),
    ("chat/completions", {"messages": [{"role": "user", "content": "Count from one to ten."}],
                          "max_tokens": 16, "stop": ["3."]}, True, True),
    ("chat/completions", {"messages": [{"role": "user", "content": "Say hi."}],
                          "max_tokens": 6, "logprobs": True, "top_logprobs": 2}, False, True),
    ("completions", {"prompt": "The capital of France is", "max_tokens": 8}, True, False),
    ("completions", {"prompt": "1, 2, 3,", "max_tokens": 16, "stop": [" 6"]}, False, True),
]


# Every test names `smollm` too: that puts this module in the group of the modules that
# share those services (tests/xdist_groups.py), which stops them after its last test.
@pytest.fixture(scope="module")
def gateways(smollm, tmp_path_factory):
    """{"colocated"/"pd": (the gateway's URL, Baton's own HTTP URL, its workers to check)}"""
    topo = smollm["topology"]
    logs = tmp_path_factory.mktemp("smg")
    col, router = smollm["colocated"], smollm["router"]
    with gateway([col], logs / "colocated.log") as a, gateway([router], logs / "pd.log") as b:
        yield {"colocated": (a.url, colocated_http(topo, col), [colocated_http(topo, col)]),
               "pd": (b.url, f"http://{topo.http[router]}", [smollm["prefill"],
                                                              smollm["decode"]])}


def model_of(base: str) -> str:
    return httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]


def ask(base: str, path: str, body: dict, stream: bool, model: str) -> dict:
    """What an OpenAI client reads of the answer: text, finish reason, token count, and
    a chat's tokens with their logprobs."""
    body = {**body, "model": model, "temperature": 0, "stream": stream}
    reply = httpx.post(f"{base}/v1/{path}", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    chat = path.startswith("chat")
    if not stream:
        c = reply.json()
        choice = c["choices"][0]
        lp = (choice.get("logprobs") or {}).get("content") if chat else None
        return {"text": choice["message"]["content"] if chat else choice["text"],
                "finish": choice["finish_reason"],
                "completion_tokens": c["usage"]["completion_tokens"],
                "logprobs": [(x["token"], x["logprob"], [t["token"] for t in x["top_logprobs"]])
                             for x in lp] if lp else None}
    text, finish = "", None
    for line in reply.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for choice in json.loads(line[6:]).get("choices", []):
                text += ((choice.get("delta") or {}).get("content") or "") if chat \
                    else choice.get("text", "")
                finish = choice.get("finish_reason") or finish
    return {"text": text, "finish": finish}


@pytest.mark.parametrize("where", ["colocated", "pd"])
def test_through_smg_greedy_answers_equal_batons_own_openai_api(smollm, gateways, where):
    smg, own, _ = gateways[where]
    model = model_of(own)
    for path, body, stream, pd in CASES:
        if where == "pd" and not pd:
            continue
        through, direct = ask(smg, path, body, stream, model), ask(own, path, body,
                                                                 stream, model)
        lp_a, lp_b = through.pop("logprobs", None), direct.pop("logprobs", None)
        assert through == direct, (where, path, body, stream)
        assert bool(through["text"]), (where, path, body)
        if "stop" in body:  # the stop string met, through the gateway too
            assert through["finish"] == "stop", (where, path, body, through)
        if lp_a is not None or lp_b is not None:
            # Same tokens and top tokens; values within bf16's noise (a prompt
            # computed with and without a cached prefix runs other chunk shapes).
            assert [(t, top) for t, _, top in lp_a] == [(t, top) for t, _, top in lp_b]
            assert all(abs(a[1] - b[1]) < 0.05 for a, b in zip(lp_a, lp_b, strict=True))


def test_a_refused_request_gets_the_gateways_error_with_batons_message(smollm, gateways):
    smg, own, _ = gateways["colocated"]
    body = {"model": model_of(own), "prompt": "hi", "max_tokens": 2, "stop": ["x" * 300]}
    reply = httpx.post(f"{smg}/v1/completions", json=body, timeout=60)
    assert reply.status_code in (400, 500), reply.text
    assert "sampling_params.stop" in reply.text and "--max-stop-chars" in reply.text


@pytest.mark.parametrize("where", ["colocated", "pd"])
def test_a_client_that_leaves_the_gateway_mid_stream_frees_every_block(smollm, gateways,
                                                                      where):
    smg, own, workers = gateways[where]
    body = {"model": model_of(own), "messages": [{"role": "user", "content": "A story."}],
            "max_tokens": 2000, "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{smg}/v1/chat/completions", json=body, timeout=60) as r:
        for n, _ in enumerate(r.iter_lines()):
            if n >= 8:
                break
        assert not all_free_within(workers, 0), "the request ran on no worker"
    assert all_free_within(workers, 5), f"{where}: blocks held after the client left"

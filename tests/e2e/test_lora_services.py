"""LoRA adapters through the services: a tiny Qwen3 served disaggregated over NIXL (a
prefill and a decode worker behind a router) and colocated, each with one adapter from
--lora-modules and one loaded at run time. Greedy tokens of a mixed batch (two adapters
and the base model, sent at once) equal transformers + peft with the adapters applied;
adapters never share cached KV; adapters load and unload while requests run, and none
fails or leaks a block."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import grpc
import pytest
import torch

from baton.services.lora.paths import UNREADABLE
from baton.v1 import generation_pb2 as gen
from baton.v1 import generation_pb2_grpc as gen_grpc
from tests.e2e.helpers import all_free_within, colocated_http, greedy, joined, run, until_served
from tests.e2e.topology import Topology, channel
from tests.lora_adapters import peft_greedy, save_adapter
from tests.tiny_models import build

FLAGS = ("--enable-lora", "--max-loras", "2", "--max-num-batched-tokens", "32")
MAX_NEW = 8
RUNTIME = ("--allow-runtime-lora-updating",)  # the load and unload routes


@pytest.fixture(scope="module")
def served(tmp_path_factory, model_path):
    from baton.services.common.tokenizer import load_tokenizer

    root = tmp_path_factory.mktemp("lora")
    hf = build("qwen3", root / "model", load_tokenizer(model_path))
    adapters = {"a": save_adapter(hf, root / "a", 4, seed=1),
                "b": save_adapter(hf, root / "b", 16, seed=2,
                                  targets=("q_proj", "v_proj", "down_proj")),
                "c": save_adapter(hf, root / "c", 8, seed=3)}
    save_adapter(hf, root / "bad", 32, seed=4)  # above --max-lora-rank
    topo = Topology(root, root / "model")
    preload = ("--lora-modules", f"a={adapters['a']}")
    confined = ("--lora-root", str(root))  # run-time loads read beneath it
    try:
        prefill = topo.worker("prefill", *FLAGS, *confined, "--kv-transport", "nixl",
                              wait=False)
        decode = topo.worker("decode", *FLAGS, *confined, "--kv-transport", "nixl",
                             wait=False)
        local = topo.worker("colocated", *FLAGS, *preload, *RUNTIME, *confined,
                            wait=False)
        topo.wait()
        router = topo.start("router", "--enable-lora", *preload, *RUNTIME, *confined,
                            "--prefill", prefill, "--decode", decode)
        yield {"hf": hf, "adapters": adapters, "root": root, "topology": topo,
               "router": router, "colocated": local,
               "workers": {"router": [prefill, decode], "colocated": [colocated_http(topo, local)]}}
    finally:
        topo.stop()


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (9, 40, 21, 17)]


def _request(prompt, lora: str = "", max_tokens: int = MAX_NEW) -> gen.GenerateRequest:
    return gen.GenerateRequest(token_ids=gen.TokenIds(ids=prompt), lora=lora,
                               sampling=greedy(max_tokens, ignore_eos=True))


def _load(address: str, name: str, path: str) -> None:
    with channel(address) as ch:
        gen_grpc.GenerationStub(ch).LoadLoraAdapter(
            gen.LoadLoraAdapterRequest(lora_name=name, lora_path=str(path)), timeout=60)


def _unload(address: str, name: str) -> None:
    with channel(address) as ch:
        gen_grpc.GenerationStub(ch).UnloadLoraAdapter(
            gen.UnloadLoraAdapterRequest(lora_name=name), timeout=60)


def _all_at_once(address: str, requests: list[gen.GenerateRequest]) -> list:
    """Every request's stream, sent together (so they share steps)."""
    out: list = [None] * len(requests)

    def one(i):
        try:
            out[i] = run(address, requests[i])
        except grpc.RpcError as e:
            out[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


@pytest.mark.parametrize("entry", ["router", "colocated"])
def test_a_mixed_batch_equals_transformers_with_peft(served, entry):
    address = served[entry]
    until_served(address, _request([5, 6, 7], max_tokens=1))
    _load(address, "b", served["adapters"]["b"])  # at run time; "a" came with the flags
    prompts = _prompts()
    jobs = [(prompts[0], "a"), (prompts[1], "b"), (prompts[2], None), (prompts[3], "a"),
            (prompts[1], None), (prompts[2], "b")]
    ref = peft_greedy(served["hf"], jobs, {n: served["adapters"][n] for n in "ab"}, MAX_NEW)
    outs = _all_at_once(address, [_request(p, n or "") for p, n in jobs])
    for (prompt, name), msgs, want in zip(jobs, outs, ref, strict=True):
        assert not isinstance(msgs, Exception), msgs
        assert joined(msgs)[0] == want, f"{entry}: adapter {name}, {len(prompt)} tokens"
    # The adapters change the model (else the comparison above proves little).
    assert ref[1] != ref[4] and ref[5] != ref[2]
    assert all_free_within(served["workers"][entry], 5.0)


def test_two_adapters_share_no_cached_tokens_and_one_adapter_does(served):
    address = served["colocated"]
    g = torch.Generator().manual_seed(9)
    prompt = torch.randint(100, 40000, (50,), generator=g).tolist()

    def cached(lora: str) -> int:
        return run(address, _request(prompt, lora, 2))[-1].usage.cached_tokens

    assert cached("a") == 0
    assert cached("") == 0  # the base model computes other KV for the same tokens
    _load(address, "c", served["adapters"]["c"])
    assert cached("c") == 0
    assert cached("a") == 48  # the same adapter again: every full block but the last
    _unload(address, "c")


def test_unknown_and_bad_adapters_are_refused_with_their_reason(served):
    router = served["router"]
    with pytest.raises(grpc.RpcError) as e:
        run(router, _request([5, 6, 7], "nope"))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as e:
        _load(router, "bad", served["root"] / "bad")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "rank 32 is above" in e.value.details()
    answers = set()  # absent (the workers refuse it), outside the root (the router does)
    for path in (served["root"] / "nowhere", served["root"].parent):
        with pytest.raises(grpc.RpcError) as e:
            _load(router, "bad", path)
        answers.add((e.value.code(), e.value.details()))
    assert answers == {(grpc.StatusCode.INVALID_ARGUMENT, UNREADABLE)}
    with pytest.raises(grpc.RpcError) as e:
        _unload(router, "nope")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    http = served["topology"].http[router]
    body = json.dumps({"model": "nope", "prompt": "hi", "max_tokens": 2}).encode()
    req = urllib.request.Request(f"http://{http}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 404
    with urllib.request.urlopen(f"http://{http}/v1/models", timeout=10) as r:
        cards = json.load(r)["data"]
    assert cards[0]["parent"] is None and "a" in [c["id"] for c in cards[1:]]
    assert all(c["parent"] == cards[0]["id"] for c in cards[1:])
    assert all(c["root"] == c["id"] for c in cards[1:])  # a name, never a server path
    assert all_free_within(served["workers"]["router"], 5.0)


def test_load_and_unload_under_load_fail_no_request(served):
    router, prompts = served["router"], _prompts()
    stop, failures, done = threading.Event(), [], [0]

    def client(lora: str, prompt):
        while not stop.is_set():
            try:
                run(router, _request(prompt, lora, 12))
                done[0] += 1
            except grpc.RpcError as e:
                failures.append((lora, e.code(), e.details()))

    threads = [threading.Thread(target=client, args=(n, p))
               for n, p in (("a", prompts[0]), ("", prompts[1]), ("a", prompts[2]))]
    for t in threads:
        t.start()
    try:
        for _ in range(2):
            _load(router, "c", served["adapters"]["c"])
            # Requests of c in flight when it is unloaded finish with it.
            ref = peft_greedy(served["hf"], [(prompts[3], "c")], {"c": served["adapters"]["c"]},
                              24)[0]
            with channel(router) as ch:  # c runs (its first token is out) ...
                stream = gen_grpc.GenerationStub(ch).Generate(_request(prompts[3], "c", 24),
                                                              timeout=60)
                msgs = [next(stream)]
                _unload(router, "c")  # ... when it is unloaded: it finishes with c
                msgs += list(stream)
            assert joined(msgs)[0] == ref
            with pytest.raises(grpc.RpcError) as e:
                run(router, _request(prompts[3], "c"))
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert failures == []
    assert done[0] > 3
    assert all_free_within(served["workers"]["router"], 5.0)

"""The whole system as processes on loopback: router -> prefill worker -> NIXL -> decode
worker. Compared against the offline engine, the workers' own KV bytes and pool stats."""

from __future__ import annotations

import signal
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from baton.services.engine import SamplingParams
from baton.services.rpc.processes import wait_healthy
from baton.v1 import generation_pb2 as gen
from baton.v1 import generation_pb2_grpc as gen_grpc
from baton.worker.v1 import worker_pb2 as wk
from baton.worker.v1 import worker_pb2_grpc as wk_grpc
from tests.e2e.conftest import both_free_within
from tests.e2e.helpers import all_free, greedy, joined, run, stats
from tests.e2e.topology import channel

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "List three prime numbers greater than one hundred:",
    "Explain what a KV cache is in one sentence. " * 4,
    "def fibonacci(n):",
    "Once upon a time, in a land of paged memory,",
]


def test_greedy_text_equals_offline_engine(topology, offline):
    want = offline.generate(PROMPTS, SamplingParams(max_tokens=32, temperature=0.0))
    for prompt, ref in zip(PROMPTS, want, strict=True):
        msgs = run(topology["router"], gen.GenerateRequest(text=prompt, sampling=greedy(32)))
        ids, text = joined(msgs)
        assert (ids, text) == (ref.token_ids, ref.text), prompt
        last = msgs[-1]
        assert gen.FinishReason.Name(last.delta.finish_reason).lower().endswith(
            ref.finish_reason)
        assert last.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert last.usage.completion_tokens == len(ref.token_ids)
        assert all(m.delta.finish_reason == 0 for m in msgs[:-1])


def test_chat_and_token_id_prompts(topology, offline):
    messages = [{"role": "user", "content": "Name a colour."}]
    ref = offline.chat(messages, SamplingParams(max_tokens=16, temperature=0.0))
    chat = gen.ChatMessages(messages=[gen.ChatMessage(**m) for m in messages])
    ids, text = joined(run(topology["router"],
                           gen.GenerateRequest(chat=chat, sampling=greedy(16))))
    assert (ids, text) == (ref.token_ids, ref.text)
    ids2, _ = joined(run(topology["router"], gen.GenerateRequest(
        token_ids=gen.TokenIds(ids=ref.prompt_token_ids), sampling=greedy(16))))
    assert ids2 == ref.token_ids


def test_first_delta_streams_before_the_last_token(topology):
    # 4,000 tokens take the tiny model 10 s here; the stats call lands within
    # milliseconds of the first decode delta. Then the client leaves.
    req = gen.GenerateRequest(text="Count slowly:", sampling=greedy(4000, ignore_eos=True))
    n = 0
    with channel(topology["router"]) as ch:
        call = gen_grpc.GenerationStub(ch).Generate(req, timeout=120)
        for msg in call:
            n += len(msg.delta.token_ids)
            if n >= 2:  # the first decode delta: the request must still be decoding
                running = stats(topology["decode"]).num_running
                break
        call.cancel()
    assert running == 1


def test_sixteen_concurrent_clients(topology, offline):
    prompts = [f"Tell me fact number {i} about the number {i * 7}." for i in range(16)]
    want = offline.generate(prompts, SamplingParams(max_tokens=20, temperature=0.0))
    got: dict[int, tuple[list[int], str]] = {}

    def client(i: int) -> None:
        got[i] = joined(run(topology["router"],
                            gen.GenerateRequest(text=prompts[i], sampling=greedy(20))))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert [got.get(i) for i in range(16)] == [(w.token_ids, w.text) for w in want]


def _tokens(router: str, text: str) -> list[int]:
    with channel(router) as ch:
        return list(gen_grpc.GenerationStub(ch).Tokenize(
            gen.TokenizeRequest(text=text)).token_ids)


def test_only_missing_blocks_move(topology, offline):
    base = "A shared system prompt that many requests start with, block after block. " * 4
    longer = base + "And then a question that only this request asks?"
    router, decode = topology["router"], topology["decode"]
    run(router, gen.GenerateRequest(text=base, sampling=greedy(4)))
    before = stats(decode)
    msgs = run(router, gen.GenerateRequest(text=longer, sampling=greedy(8)))
    after = stats(decode)
    n_base, n_long = len(_tokens(router, base)), len(_tokens(router, longer))
    pulled = after.num_blocks_pulled - before.num_blocks_pulled
    local = after.num_blocks_local - before.num_blocks_local
    assert local == n_base // 16
    assert pulled == -(-n_long // 16) - n_base // 16
    ref = offline.generate([longer], SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert joined(msgs)[0] == ref.token_ids


@pytest.mark.parametrize("after", [1, 4], ids=["after-first-token", "mid-decode"])
def test_cancel_frees_every_block_within_a_second(topology, after):
    req = gen.GenerateRequest(text="Write a very long story.",  # 10 s of decoding
                              sampling=greedy(4000, ignore_eos=True))
    with channel(topology["router"]) as ch:
        call = gen_grpc.GenerationStub(ch).Generate(req, timeout=120)
        for i, _ in enumerate(call, 1):
            if i == after:
                break
        if after > 1:
            assert not all_free(topology["decode"])
        call.cancel()
    assert both_free_within(topology, 1.0)


def test_deadline_ends_the_request_everywhere(topology):
    """The deadline lands while the decode worker holds the request: paused mid-decode
    (SIGSTOP), so it cannot finish first however fast it decodes. Behind a router of its
    own that waits a minute before it calls a silent worker down (the session router
    calls it down meanwhile, and up again after)."""
    topo, decode = topology["topology"], topology["decode"]
    router = topo.start("router", "--prefill", topology["prefill"], "--decode", decode,
                        "--worker-timeout", "60")
    req = gen.GenerateRequest(text="Write a very long story.",
                              sampling=greedy(4000, ignore_eos=True))
    generated, n = stats(decode).num_generation_tokens, 0
    try:
        with channel(router) as ch, pytest.raises(grpc.RpcError) as e:
            for msg in gen_grpc.GenerationStub(ch).Generate(req, timeout=3.0):
                n += len(msg.delta.token_ids)
                if n >= 2 and n == len(msg.delta.token_ids) + 1:  # the first decode delta
                    topo.kill(decode, signal.SIGSTOP)
    finally:
        topo.kill(decode, signal.SIGCONT)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert both_free_within(topology, 20.0)  # well before a lease could expire (30 s)
    # Ended there, not run to its end (however fast the worker would get there).
    assert stats(decode).num_generation_tokens - generated < 4000
    session = topology["router"]
    wait_healthy(session, topo.process(session), timeout=60)  # the decode worker up there


def test_bad_input_gets_invalid_argument(topology):
    cases = [gen.GenerateRequest(text="x" * 2_000_000),  # refused before tokenizing
             gen.GenerateRequest(text=""),
             gen.GenerateRequest(text="hi", sampling=gen.SamplingParams(temperature=-1)),
             gen.GenerateRequest(token_ids=gen.TokenIds(ids=[10**8])),
             gen.GenerateRequest()]
    named = ["text", "prompt", "temperature", "token_ids", "prompt"]
    for req, field in zip(cases, named, strict=True):
        with pytest.raises(grpc.RpcError) as e:
            run(topology["router"], req)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, req
        assert field in e.value.details(), (field, e.value.details())
    assert all_free(topology["prefill"]) and all_free(topology["decode"])


@pytest.mark.parametrize("role", ["router", "prefill", "decode"])
def test_health_and_reflection(topology, role):
    address = topology[role]
    with channel(address) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                     timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        [resp] = list(stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5))
        names = {s.name for s in resp.list_services_response.service}
    # The router's port serves its own API and vLLM's gRPC engine API (issue 56).
    expected = {"router": {"baton.v1.Generation", "vllm.grpc.engine.VllmEngine"},
                "prefill": {"baton.worker.v1.PrefillService"},
                "decode": {"baton.worker.v1.DecodeService"}}[role]
    assert expected | {"grpc.health.v1.Health"} <= names


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_worker_refuses_a_caller_without_the_cluster_token(topology, role):
    with grpc.insecure_channel(topology[role]) as ch:
        with pytest.raises(grpc.RpcError) as e:
            wk_grpc.WorkerServiceStub(ch).GetStats(wk.GetStatsRequest(), timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_decode_worker_with_other_block_size_is_rejected(topology, offline):
    topo = topology["topology"]
    bad = topo.worker("decode", "--block-size", "32", "--kv-transport", "nixl")
    with channel(bad) as ch:
        with pytest.raises(grpc.RpcError) as e:
            wk_grpc.DecodeServiceStub(ch).Connect(
                wk.ConnectRequest(prefill_address=topology["prefill"]), timeout=30)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "block_size" in e.value.details()
    # A router whose only decode worker cannot pair with its prefill worker still serves:
    # it skips that prefill worker, and the decode worker prefills every prompt itself.
    prefill = topology["prefill"]
    queries = stats(prefill).prefix_cache_queries
    router = topo.start("router", "--prefill", prefill, "--decode", bad)
    ref = offline.generate(["Paired or not?"], SamplingParams(max_tokens=8,
                                                               temperature=0.0))[0]
    msgs = run(router, gen.GenerateRequest(text="Paired or not?", sampling=greedy(8)))
    assert joined(msgs) == (ref.token_ids, ref.text)
    assert stats(prefill).prefix_cache_queries == queries  # the prefill worker saw none

"""Many clients misbehaving at once, and fuzzed requests, against the session topology:
afterwards every block on every worker is free and no lease remains; every answer is OK or
INVALID_ARGUMENT; the workers stay up."""

from __future__ import annotations

import random
import threading

import grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from baton.v1 import generation_pb2 as gen
from baton.v1 import generation_pb2_grpc as gen_grpc
from tests.e2e.conftest import both_free_within
from tests.e2e.helpers import all_free_within, stats
from tests.e2e.topology import channel


def test_200_requests_with_cancellations_and_short_deadlines_leak_nothing(topology):
    rng = random.Random(0)
    plans = [(rng.choice(["finish", "cancel", "deadline"]), rng.randint(1, 24),
              rng.uniform(0.05, 1.5), rng.randint(1, 6)) for _ in range(200)]
    outcomes: dict[str, int] = {}
    lock = threading.Lock()
    todo = list(enumerate(plans))

    def client() -> None:
        with channel(topology["router"]) as ch:
            stub = gen_grpc.GenerationStub(ch)
            while True:
                with lock:
                    if not todo:
                        return
                    i, (kind, max_tokens, deadline, cancel_after) = todo.pop()
                req = gen.GenerateRequest(
                    text=f"Request {i}: tell me about the number {i}. " * (1 + i % 4),
                    sampling=gen.SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                ignore_eos=True))
                timeout = deadline if kind == "deadline" else 120
                call = stub.Generate(req, timeout=timeout)
                try:
                    for n, _ in enumerate(call, 1):
                        if kind == "cancel" and n == cancel_after:
                            call.cancel()
                            break
                    result = "ok"
                except grpc.RpcError as e:
                    result = e.code().name
                with lock:
                    outcomes[result] = outcomes.get(result, 0) + 1

    threads = [threading.Thread(target=client) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert sum(outcomes.values()) == 200
    assert set(outcomes) <= {"ok", "CANCELLED", "DEADLINE_EXCEEDED"}, outcomes
    assert both_free_within(topology, 5.0), (stats(topology["prefill"]), stats(topology["decode"]))


_floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32),
                    st.sampled_from([0.0, 0.5, 1.0, -1.0]))
_sampling = st.builds(
    gen.SamplingParams,
    max_tokens=st.integers(-5, 6), temperature=_floats, top_p=_floats,
    top_k=st.integers(-3, 60000), min_p=_floats, seed=st.integers(-2**63, 2**63 - 1),
    repetition_penalty=_floats, presence_penalty=_floats, frequency_penalty=_floats,
    stop=st.lists(st.text(max_size=4), max_size=2),
    stop_token_ids=st.lists(st.integers(0, 2**31 - 1), max_size=2),
    ignore_eos=st.booleans(), logprobs=st.integers(-2, 25))
_prompt = st.one_of(
    st.builds(lambda t: {"text": t}, st.text(max_size=80)),
    st.builds(lambda ids: {"token_ids": gen.TokenIds(ids=ids)},
              st.lists(st.integers(-2**31, 2**31 - 1), max_size=40)),
    st.builds(lambda ms: {"chat": gen.ChatMessages(messages=ms)},
              st.lists(st.builds(gen.ChatMessage, role=st.sampled_from(
                  ["user", "assistant", "system", "", "robot"]), content=st.text(max_size=30)),
                  max_size=3)))


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=_prompt, sampling=_sampling, priority=st.integers(-2**31, 2**31 - 1))
def test_fuzzed_requests_get_ok_or_invalid_argument(topology, prompt, sampling, priority):
    req = gen.GenerateRequest(sampling=sampling, priority=priority, **prompt)
    with channel(topology["router"]) as ch:
        try:
            list(gen_grpc.GenerationStub(ch).Generate(req, timeout=60))
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details())
            assert e.details()


def test_workers_are_up_and_clean_after_the_fuzzing(topology):
    assert both_free_within(topology, 5.0)


def _short_deadline_client(router: str, round_no: int, plans: list, outcomes: dict,
                           lock: threading.Lock) -> None:
    with channel(router) as ch:
        stub = gen_grpc.GenerationStub(ch)
        while True:
            with lock:
                if not plans:
                    return
                i, deadline, max_tokens = plans.pop()
            text = f"Round {round_no}, request {i}: a few words on harbours. " * (1 + i % 3)
            req = gen.GenerateRequest(text=text, sampling=gen.SamplingParams(
                max_tokens=max_tokens, temperature=0.0))
            try:
                list(stub.Generate(req, timeout=deadline))
                result = "ok"
            except grpc.RpcError as e:
                result = e.code().name
            with lock:
                outcomes[result] = outcomes.get(result, 0) + 1


def test_deadlines_that_land_during_admission_leave_every_worker_clean(topology):
    """Hundreds of requests whose deadlines (10 to 250 ms) land while the workers admit
    them, round after round: after every round, every block is free and no lease held."""
    rng = random.Random(1)
    workers = [topology["prefill"], topology["decode"]]
    for round_no in range(5):
        plans = [(i, rng.uniform(0.01, 0.25), rng.randint(1, 16)) for i in range(100)]
        outcomes: dict[str, int] = {}
        lock = threading.Lock()
        threads = [threading.Thread(target=_short_deadline_client, args=(
            topology["router"], round_no, plans, outcomes, lock)) for _ in range(24)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert set(outcomes) <= {"ok", "DEADLINE_EXCEEDED"}, outcomes
        assert all_free_within(workers, 5.0), (
            f"round {round_no} left work behind: {outcomes} "
            f"{stats(topology['prefill'])} {stats(topology['decode'])}")

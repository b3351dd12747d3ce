"""The planner's simulator on a hand-made profile, against step times computed by hand:
a lone request's TTFT is the sum of its prefill chunks' times plus the hand-off, a
decode batch's inter-token gap is its step time, the first gap after a hand-off is the
hand-off, the pull and one step; a pull shares its workers' cores with their steps;
runs are the same for the same seed; and the step model, fitted to steps of known cost,
gives that cost back."""

from __future__ import annotations

import pytest

from baton.router.policy import Policy
from baton.tools.bench.goodput_load import Job, arrivals, jobs
from baton.tools.plan.simulator import Simulation, Topology, named, simulate
from baton.tools.plan.step_model import StepModel

D, P, S = 0.020, 0.001, 0.0005  # a decode step's base, per extra token, per sequence
HAND = {"pull_fixed_s": 0.010, "pull_per_block_s": 0.0004, "to_prefill_s": 0.003,
        "to_decode_s": 0.004}


def profile(k_seq: float = 0.0) -> dict:
    model = StepModel((1, 2), (D, D + P), k_seq, 0.0).to_json()
    engine = {"threads": 1, "tensor_parallel": 1, "block_bytes": 368640,  # SmolLM2-135M, bf16
              "max_model_len": 4096, "model": model}
    return {"block_size": 16, "engines": [engine, {**engine, "threads": 2}],
            "handoff": {"nixl": HAND}}


def step(tokens: int, seqs: int = 1, k_seq: float = 0.0) -> float:
    return D + P * (tokens - 1) + k_seq * seqs


def test_a_lone_requests_ttft_is_its_chunks_plus_the_hand_off():
    topo = Topology("pd", policy=Policy(disaggregation="always"), max_num_batched_tokens=32)
    sim = Simulation(topo, profile())
    (t,) = sim.run([Job(list(range(100, 200)), 4)], [0.25])
    chunks = [32, 32, 32, 4]  # 100 prompt tokens in steps of at most 32
    assert t.ttft == pytest.approx(sum(step(n) for n in chunks) + HAND["to_prefill_s"])
    blocks = -(-100 // 16)
    pull = HAND["pull_fixed_s"] + HAND["pull_per_block_s"] * blocks
    # The first gap: the router hands it over, the decode worker pulls, then one step
    # (the pull outlasts the scheduler's 5 ms wait for it: it lands as its own event).
    assert t.itls[0] == pytest.approx(HAND["to_decode_s"] + pull + step(1))
    assert t.itls[1:] == pytest.approx([step(1)] * 2)
    assert sim.sims["prefill-0"].pool.num_free_blocks == sim.sims["prefill-0"].pool.num_blocks - 1
    assert sim.sims["decode-0"].pool.num_free_blocks == sim.sims["decode-0"].pool.num_blocks - 1


def test_score_counts_each_workers_step_seconds_over_every_seed():
    """What the planner's check sets beside each process's measured CPU: the steps'
    seconds, per worker, every seed's run added."""
    from baton.tools.plan.scoring import score

    topo = Topology("pd", policy=Policy(disaggregation="always"), max_num_batched_tokens=32)
    one = ([Job(list(range(100, 200)), 4)], [0.25])
    busy = score(topo, profile(), [one, one], {}, 1.0)["busy_s"]
    prefill = sum(step(n) for n in (32, 32, 32, 4))
    assert busy == pytest.approx({"prefill-0": 2 * prefill, "decode-0": 2 * 3 * step(1)})


def test_a_prompt_joins_the_running_decode_and_then_both_decode_together():
    k = 0.002
    sim = Simulation(named("colocated", decode_threads=1), profile(k))
    a, b = sim.run([Job(list(range(100, 120)), 6), Job(list(range(300, 320)), 6)], [0.0, 0.0])
    hop = HAND["to_prefill_s"]
    # a's prompt alone (the engine was idle when it came), then b's prompt beside a's
    # first decode, then both decode in every step.
    assert a.ttft == pytest.approx(step(20, 1, k) + hop)
    assert b.ttft == pytest.approx(step(20, 1, k) + step(21, 2, k) + hop)
    assert a.itls == pytest.approx([step(21, 2, k)] + [step(2, 2, k)] * 4)
    assert b.itls == pytest.approx([step(2, 2, k)] * 4 + [step(1, 1, k)])


def test_a_pull_slows_the_decode_step_beside_it():
    """b's pull starts as a's decode step does, on the decode worker's one core: that
    step takes min(pull, step) longer (sim_worker.SimWorker.core_busy); no other does."""
    topo = Topology("pd", policy=Policy(disaggregation="always"), max_num_batched_tokens=256)
    sim = Simulation(topo, profile())
    a, _ = sim.run([Job(list(range(100, 200)), 20), Job(list(range(300, 400)), 4)], [0.0, 0.1])
    pull = HAND["pull_fixed_s"] + HAND["pull_per_block_s"] * -(-100 // 16)
    slowed = [g for g in a.itls[1:] if g not in (pytest.approx(step(1)), pytest.approx(step(2)))]
    assert slowed == pytest.approx([step(1) + min(pull, step(1))])


def test_a_pull_slows_the_sending_workers_next_step_too():
    """The prefill worker's side of a pull (its NIXL thread on its core): a step that
    starts while it runs takes min(what is left of it, the step) longer."""
    sim = Simulation(named("pd-always"), profile())
    prefill = sim.sims["prefill-0"]
    prefill.spans.append((0.0, 0.050))  # a pull running until 50 ms
    (t,) = sim.run([Job(list(range(100, 110)), 2)], [0.030])  # its prompt at 30 ms
    assert t.ttft == pytest.approx(step(10) + min(0.050 - 0.030, step(10))
                                   + HAND["to_prefill_s"])


def test_local_prefill_when_the_prompt_is_short():
    sim = Simulation(named("pd"), profile())  # auto: 32 tokens or fewer stay on decode
    (t,) = sim.run([Job(list(range(100, 120)), 3)], [0.0])
    assert t.ttft == pytest.approx(step(20) + HAND["to_prefill_s"])
    assert sim.sims["prefill-0"].steps == 0 and sim.sims["decode-0"].steps == 3


def test_the_same_seed_gives_the_same_run_and_the_pools_end_empty():
    work, sent = jobs("w3", 30, 0, 49152), arrivals(30, 2.0, 1.0, 0)
    slos = {"ttft": 2000.0, "tpot": 70.0}
    runs = [simulate(named(t), profile(), work, sent, slos) for t in ("pd", "pd")]
    assert runs[0] == runs[1]
    assert runs[0]["completed"] == 30
    sim = Simulation(named("pd"), profile())
    sim.run(work, sent)
    for w in sim.sims.values():  # every block back, no lease left
        assert w.pool.num_free_blocks == w.pool.num_blocks - 1
        assert not w.scheduler.leases and not w.scheduler.has_unfinished_requests()


def test_the_step_model_gives_back_the_costs_it_was_fitted_to():
    truth = StepModel((1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
                      (0.02, 0.021, 0.022, 0.024, 0.03, 0.04, 0.06, 0.1, 0.18, 0.34),
                      0.0003, 0.00002)
    batches = [[(n, c)] for n in (1, 16, 64, 128, 256, 512) for c in (0, 256, 1024)]
    batches += [[(1, c)] * b for b in (2, 4, 8, 32) for c in (128, 1024)]
    batches += [[(1, 500)] * 4 + [(200, 0)], [(1, 100)] * 16 + [(64, 512)]]
    fitted = StepModel.fit([(b, truth.predict(b)) for b in batches])
    for b in ([(300, 700)], [(1, 2000)] * 12, [(1, 64)] * 3 + [(100, 0)]):
        assert fitted.predict(b) == pytest.approx(truth.predict(b), rel=0.02)
    with pytest.raises(ValueError, match="at least 4"):
        StepModel.fit([([(1, 0)], 0.02)])


def test_served_costs_scale_prompt_steps_and_add_to_decode_steps():
    """calibrate.py's costs: a step of prompt tokens times `prefill`, a step of decodes
    plus `decode_extra_s`, a step of both by the share of its tokens that are prompt
    tokens."""
    served = profile()
    for e in served["engines"]:
        e["service"] = {"prefill": 2.0, "decode": 1.5, "decode_extra_s": 0.004}
    sim = Simulation(named("colocated", decode_threads=1), served)
    a, b = sim.run([Job(list(range(100, 120)), 3), Job(list(range(300, 310)), 2)], [0.0, 0.0])
    hop = HAND["to_prefill_s"]
    assert a.ttft == pytest.approx(2.0 * step(20) + hop)
    # b's 10 prompt tokens beside a's decode: 10 of the step's 11 tokens are prompt.
    mixed = step(11) * (1 + 1.0 * 10 / 11) + 0.004 * 1 / 11
    assert a.itls == pytest.approx([mixed, step(2) + 0.004])
    assert b.itls == pytest.approx([step(2) + 0.004])


def test_a_calibration_prompt_longer_than_a_step_is_timed_as_its_chunks():
    """A served prompt past the step budget runs in chunks: its offline time, which the
    served TTFT is set against, is each chunk's step over the tokens before it."""
    from baton.tools.plan.calibrate import prompt_seconds

    model = StepModel.constant(P, D)
    assert prompt_seconds(model, 1024) == pytest.approx(D + P * 1023)
    # 5,000 tokens in steps of 2,048: 2,048 + 2,048 + 904
    assert prompt_seconds(model, 5000, 2048) == pytest.approx(3 * D + P * (2047 + 2047 + 903))


def test_a_prompt_no_engine_can_hold_ends_the_run_with_an_error():
    """Longer than the pool: the scheduler never admits it, so the run stops at its
    limit and says so, instead of polling forever."""
    small = profile()
    for e in small["engines"]:
        e["block_bytes"] = 2**30 // 8  # 8 blocks of 16 tokens in a GiB's pool
    sim = Simulation(named("colocated", decode_threads=1), small)
    (t,) = sim.run([Job(list(range(100, 400)), 2)], [0.0], limit_s=60.0)
    assert t.error == "unfinished at the simulation's limit" and not t.ok

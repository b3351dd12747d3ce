"""LoRA adapters in the engine: greedy fp32 output equals transformers + peft (adapter
applied, not merged) token for token, in mixed batches with base-model requests, under
chunked prefill and prefix-cache hits; adapters never share cached blocks; at most
max_loras adapters run in a step; an adapter unloaded mid-flight serves its running
requests to the end and no new one. Bad input: test_lora_errors.py."""

from __future__ import annotations

import random

import pytest

from baton.services.common.capacity import AtCapacity
from baton.services.common.errors import NotFound
from baton.services.engine import SamplingParams
from baton.services.lora.adapter import LoRARequest
from tests.integration.engine_helpers import kv_gib, run_steps
from tests.lora_adapters import peft_forced, peft_greedy, save_adapter

MAX_NEW = 8
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
# name -> save_adapter's (rank, seed, targets, rslora)
KINDS = {"r4": (4, 1, None, False),
         "r16rs": (16, 2, None, True),  # rank 16, scaled alpha / sqrt(r)
         "part": (8, 3, ["q_proj", "v_proj", "down_proj"], False),
         "r2": (2, 4, ["k_proj", "o_proj", "gate_proj", "up_proj"], False)}


def make_adapters(model, folder, names) -> dict:
    out = {}
    for name in names:
        rank, seed, targets, rslora = KINDS[name]
        kw = {"targets": targets} if targets else {}
        out[name] = save_adapter(model, folder / name, rank, seed, rslora=rslora, **kw)
    return out


def random_prompts(lengths, seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(n)] for n in lengths]


def run(engine, jobs) -> list:
    """Queue every (prompt, adapter name or None) at once and step to the end; the final
    outputs in the jobs' order."""
    ids = [engine.add_request(p, GREEDY, lora=LoRARequest(n) if n else None) for p, n in jobs]
    per_req, _ = run_steps(engine)
    return [per_req[i][-1] for i in ids]


def check_parity(engine, model, adapters, prompts, forced: bool = False) -> None:
    """Every prompt under the base model and every adapter, in one batch: peft's tokens
    (`forced`: checked by peft_forced); each adapter changes some prompt's output; a
    prompt splits across steps."""
    names = [None, *adapters]
    jobs = [(p, n) for p in prompts for n in names]
    partial = engine.scheduler.num_partial_prefills
    outs = run(engine, jobs)
    if forced:
        forced_jobs = [(p, n, o.token_ids) for (p, n), o in zip(jobs, outs, strict=True)]
        want = peft_forced(model, forced_jobs, adapters)
    else:
        want = peft_greedy(model, jobs, adapters, MAX_NEW)
    assert engine.scheduler.num_partial_prefills > partial, "a prompt was meant to be chunked"
    got = {(tuple(p), n): o.token_ids for (p, n), o in zip(jobs, outs, strict=True)}
    for (p, n), w in zip(jobs, want, strict=True):
        assert got[tuple(p), n] == w, f"adapter {n}, prompt of {len(p)} tokens diverged"
    for n in adapters:
        assert any(got[tuple(p), n] != got[tuple(p), None] for p in prompts), \
            f"adapter {n} changed no output: it was not applied"
    # The same adapter and prompt again: its full blocks come from the prefix cache.
    again = [(p, n) for p in prompts if len(p) > 16 for n in adapters]
    for (p, n), o in zip(again, run(engine, again), strict=True):
        assert o.num_cached_tokens == (len(p) - 1) // 16 * 16
        assert o.token_ids == got[tuple(p), n], f"adapter {n} changed on a cache hit"


# ---- the tiny Qwen3 -------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, model_path):
    """(HF reference model, its directory, {adapter name: PEFT directory})."""
    from baton.services.common.tokenizer import load_tokenizer
    from tests.tiny_models import build

    root = tmp_path_factory.mktemp("lora-qwen3")
    model = build("qwen3", root / "model", load_tokenizer(model_path))
    return model, root / "model", make_adapters(model, root, KINDS)


def make_engine(make_llm, folder, **kw):
    kw = {"max_num_batched_tokens": 32, "max_num_seqs": 16, **kw}
    return make_llm(model=str(folder), dtype="float32", enable_lora=True,
                    kv_cache_gib=kv_gib(folder, 96), **kw).engine


@pytest.fixture(scope="module")
def four(make_llm, qwen3):
    """An engine over the tiny Qwen3 with every adapter loaded; four fit in a step."""
    model, folder, adapters = qwen3
    engine = make_engine(make_llm, folder, max_loras=4)
    for name, path in adapters.items():
        engine.load_lora(name, str(path))
    return engine


def test_tiny_qwen3_matches_peft_in_a_mixed_batch(qwen3, four):
    model, _, adapters = qwen3
    assert four.stats().loras == tuple(sorted(KINDS))
    use = {n: adapters[n] for n in ("r4", "r16rs", "part")}
    check_parity(four, model, use, random_prompts((5, 17, 40), 0, model.config.vocab_size))


def test_adapters_never_share_cached_blocks(qwen3, four):
    model = qwen3[0]
    [p] = random_prompts((40,), 1, model.config.vocab_size)
    first = run(four, [(p, "r4")])[0]
    assert first.num_cached_tokens == 0
    for name in ("part", None):  # another adapter, then the base model, after r4
        assert run(four, [(p, name)])[0].num_cached_tokens == 0, f"{name} hit r4's blocks"
    for name in ("r4", None):  # each again: its own blocks
        out = run(four, [(p, name)])[0]
        assert out.num_cached_tokens == 32, f"{name} missed its own cached blocks"
    assert run(four, [(p, "r4")])[0].token_ids == first.token_ids


def test_at_most_max_loras_adapters_per_step(make_llm, qwen3, monkeypatch):
    model, folder, adapters = qwen3
    engine = make_engine(make_llm, folder, max_loras=2)
    for name, path in adapters.items():
        engine.load_lora(name, str(path))
    slots = engine.runner.lora
    steps: list[set[str]] = []
    prepare = slots.prepare

    def record(names):
        steps.append({n for n in names if n is not None})
        return prepare(names)

    monkeypatch.setattr(slots, "prepare", record)
    prompts = random_prompts((9, 20, 6, 33, 12, 7), 2, model.config.vocab_size)
    # r4 comes back after the slots were given to part and r2: its slot is rewritten.
    names = ["r4", "r16rs", "part", "r2", "r4", None]
    jobs = list(zip(prompts, names, strict=True))
    want = peft_greedy(model, jobs, adapters, MAX_NEW)
    outs = run(engine, jobs)
    for (p, n), o, w in zip(jobs, outs, want, strict=True):
        assert o.token_ids == w, f"adapter {n}, prompt of {len(p)} tokens diverged"
    assert max(map(len, steps)) == 2, f"adapters per step: {[sorted(s) for s in steps]}"
    assert set().union(*steps) == set(KINDS)


def test_requests_that_fit_pass_one_waiting_for_its_adapter_for_a_while(make_llm, qwen3):
    """max_loras 1, r4 running: a request of part must wait, and a base-model request
    behind it runs meanwhile; once part has waited lora_pass_s, nothing passes it (the
    running adapter drains, then part runs). Every output is still peft's."""
    model, folder, adapters = qwen3
    engine = make_engine(make_llm, folder, max_loras=1)
    prompts = random_prompts((9, 12, 7, 10), 6, model.config.vocab_size)
    jobs = list(zip(prompts, ["r4", "part", None, None], strict=True))
    rids = [engine.add_request(p, GREEDY, lora=LoRARequest(n, lora_path=str(adapters[n]))
                               if n else None) for p, n in jobs[:3]]
    engine.step()
    status = {r: engine.scheduler.requests[r].status.name for r in rids}
    assert list(status.values()) == ["RUNNING", "WAITING", "RUNNING"]
    engine.scheduler.lora_pass_s = 0.0  # part has now waited long enough
    rids.append(engine.add_request(jobs[3][0], GREEDY))
    engine.step()
    assert engine.scheduler.requests[rids[3]].status.name == "WAITING", "it passed part"
    per_req, _ = run_steps(engine)
    want = peft_greedy(model, jobs, adapters, MAX_NEW)
    assert [per_req[r][-1].token_ids for r in rids] == want

def test_unload_with_requests_in_flight(qwen3, four, tmp_path):
    model, _, adapters = qwen3
    x = save_adapter(model, tmp_path / "x", 8, 7)
    four.load_lora("x", str(x))
    prompts = random_prompts((30, 6), 3, model.config.vocab_size)
    want = peft_greedy(model, [(p, "x") for p in prompts], {"x": x}, MAX_NEW)
    ids = [four.add_request(p, GREEDY, lora=LoRARequest("x")) for p in prompts]
    four.step()
    assert four.unload_lora("x") is True
    assert "x" not in four.stats().loras
    assert "x" in four.runner.lora.adapters, "dropped while its requests run"
    queued = set(four.scheduler.requests)
    with pytest.raises(NotFound, match="'x'"):
        four.add_request(prompts[1], GREEDY, lora=LoRARequest("x"))
    assert set(four.scheduler.requests) == queued, "a refused request was queued"
    per_req, _ = run_steps(four)
    assert [per_req[i][-1].token_ids for i in ids] == want
    assert "x" not in four.runner.lora.adapters and "x" not in four.runner.lora.slot_of
    assert "x" not in four.stats().loras
    assert four.unload_lora("x") is False
    # An idle adapter is dropped at once; a request naming its path loads it again.
    assert four.unload_lora("r2") is True and "r2" not in four.runner.lora.adapters
    out = run_with_path(four, prompts[0], "r2", adapters["r2"])
    assert out.token_ids == peft_greedy(model, [(prompts[0], "r2")], adapters, MAX_NEW)[0]
    assert "r2" in four.stats().loras


def test_unload_then_abort_drops_the_adapter(qwen3, four, tmp_path):
    """The last request of an unloaded adapter aborted: the adapter leaves the host then,
    not at some later step that happens to schedule work."""
    model = qwen3[0]
    four.load_lora("y", str(save_adapter(model, tmp_path / "y", 4, 8)))
    rid = four.add_request(random_prompts((20,), 6, model.config.vocab_size)[0], GREEDY,
                           lora=LoRARequest("y"))
    four.step()
    assert four.unload_lora("y") is True
    four.abort_request(rid)
    assert "y" not in list(four.runner.lora.adapters), "unloaded, yet held after its requests"


def test_a_name_bound_to_new_weights_reuses_no_old_blocks(qwen3, four):
    """An adapter replaced under its name (load again, or unload and load) must not hit
    the KV blocks its old weights computed: the tokens are the new weights' tokens."""
    model, _, adapters = qwen3
    [p] = random_prompts((40,), 7, model.config.vocab_size)
    four.load_lora("same", str(adapters["r4"]))
    assert run(four, [(p, "same")])[0].num_cached_tokens == 0
    for rebind, now in (("load", "part"), ("unload and load", "r16rs")):
        if rebind == "unload and load":
            assert four.unload_lora("same") is True
        four.load_lora("same", str(adapters[now]))
        out = run(four, [(p, "same")])[0]
        want = peft_greedy(model, [(p, now)], adapters, MAX_NEW)[0]
        assert (out.num_cached_tokens, out.token_ids) == (0, want), \
            f"after {rebind}, the old weights' cached KV was reused"
    assert four.unload_lora("same") is True


def run_with_path(engine, prompt, name, path):
    rid = engine.add_request(prompt, GREEDY, lora=LoRARequest(name, lora_path=str(path)))
    return run_steps(engine)[0][rid][-1]


def test_host_keeps_max_cpu_loras_and_reloads_on_use(make_llm, qwen3):
    """max_cpu_loras 1: loading a second adapter evicts the idle first from the host; the
    first is read again when a request names it. With the only one in use, a request for
    another is refused, not queued."""
    model, folder, adapters = qwen3
    engine = make_engine(make_llm, folder, max_loras=1, max_cpu_loras=1)
    engine.load_lora("r4", str(adapters["r4"]))
    engine.load_lora("part", str(adapters["part"]))
    assert list(engine.runner.lora.adapters) == ["part"]
    assert engine.stats().loras == ("part", "r4")
    [p] = random_prompts((18,), 4, model.config.vocab_size)
    rid = engine.add_request(p, GREEDY, lora=LoRARequest("r4"))
    assert list(engine.runner.lora.adapters) == ["r4"]
    engine.step()
    with pytest.raises(AtCapacity, match="in use"):  # RESOURCE_EXHAUSTED: come back later
        engine.add_request(p, GREEDY, lora=LoRARequest("part"))
    assert set(engine.scheduler.requests) == {rid}
    per_req, _ = run_steps(engine)
    assert per_req[rid][-1].token_ids == peft_greedy(model, [(p, "r4")], adapters, MAX_NEW)[0]


def test_ngram_drafts_run_under_their_adapter(make_llm, qwen3):
    """Speculative decoding verifies a request's drafts in the same rows as its token:
    each row must carry the request's adapter (greedy output is peft's, drafts or not)."""
    from baton.services.engine.config import SpecConfig

    model, folder, adapters = qwen3
    engine = make_engine(make_llm, folder, max_loras=2, speculative=SpecConfig(
        method="ngram", num_speculative_tokens=3, ngram_min=1, ngram_max=2))
    engine.load_lora("r4", str(adapters["r4"]))
    # Under r4 this prompt's greedy output ends in a run of one token: drafts of it are
    # accepted, so rows after a request's first carry KV and tokens that are kept.
    p, q = random_prompts((6, 6), 5, model.config.vocab_size)
    jobs = [(p, "r4"), (q, None), (p + q, "r4")]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    ids = [engine.add_request(p, params, lora=LoRARequest(n) if n else None)
           for p, n in jobs]
    per_req, _ = run_steps(engine)
    stats = engine.stats()
    assert stats.num_spec_accepted_tokens > 0, "no draft was accepted"
    assert [per_req[i][-1].token_ids for i in ids] == peft_greedy(model, jobs, adapters, 24)


# ---- the default model ----------------------------------------------------------------


def test_default_model_matches_peft_in_a_mixed_batch(make_llm, hf_model, tmp_path):
    adapters = make_adapters(hf_model, tmp_path, ("r4", "r16rs"))
    llm = make_llm(dtype="float32", enable_lora=True, max_loras=2, max_num_batched_tokens=32,
                   max_num_seqs=16, kv_cache_gib=0.03)
    for name, path in adapters.items():
        llm.engine.load_lora(name, str(path))
    prompts = random_prompts((5, 40), 5, hf_model.config.vocab_size)
    check_parity(llm.engine, hf_model, adapters, prompts, forced=True)


def test_versions_order_the_bindings_of_a_name(qwen3, four):
    """A worker's reads carry the router's version: one that lands after a newer one was
    bound (a request's slow read, racing a reload) changes nothing; a newer one rebinds (a
    reload the worker missed)."""
    model, _, adapters = qwen3
    loras = four.loras
    old, new = (loras.read("v", str(adapters[k])) for k in ("r4", "part"))
    assert loras.keep(new, version=5)
    assert not loras.keep(old, version=3)  # the older read lands late: dropped
    assert loras.paths["v"] == str(adapters["part"])
    assert loras.holds("v", 5) and not loras.holds("v", 6)
    [p] = random_prompts((20,), 8, model.config.vocab_size)
    want = peft_greedy(model, [(p, "part"), (p, "r4")], adapters, MAX_NEW)
    assert run(four, [(p, "v")])[0].token_ids == want[0]
    assert loras.keep(old, version=6)  # newer: it rebinds, with none of part's blocks
    out = run(four, [(p, "v")])[0]
    assert out.token_ids == want[1] and out.num_cached_tokens == 0
    assert four.unload_lora("v")

"""Speculative decoding: the n-gram proposer against a brute-force search, greedy output
with drafts equal to greedy output without them (fp32, under chunked prefill, prefix
caching, preemption, stop strings and max_tokens), the rejection sampler's distribution
against the target's, and the acceptance counters."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from baton.services.engine import SamplingParams
from baton.services.engine.config import SpecConfig
from baton.services.engine.ngram_index import NgramIndex
from baton.services.engine.sampler import Sampler, SamplingRow
from tests.integration.engine_helpers import assert_idle, greedy, run_steps

# The batch-size threshold lifted: these tests check the mechanism on batches of 8.
SPEC = SpecConfig(method="ngram", num_speculative_tokens=4, ngram_min=2, ngram_max=4,
                  disable_batch_size=16)
# Text whose continuation repeats it, so the proposer hits.
PASSAGE = ("The quick brown fox jumps over the lazy dog. The dog sleeps in the sun while "
           "the fox runs into the forest to find food for its family.")


def brute_force(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """The tokens after the latest earlier occurrence of the longest trailing n-gram."""
    for n in range(min(hi, len(tokens)), lo - 1, -1):
        tail = tokens[-n:]
        for i in range(len(tokens) - n - 1, -1, -1):
            if tokens[i:i + n] == tail:
                return tokens[i + n:i + n + k]
    return []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=60), st.integers(1, 3),
       st.integers(0, 3), st.integers(1, 5), st.integers(1, 40))
def test_ngram_index_finds_what_a_brute_force_search_finds(tokens, lo, extra, k, split):
    hi = lo + extra
    index = NgramIndex(lo, hi)
    # Indexed in two goes, as a request grows between steps.
    index.propose(tokens[:split], k)
    assert index.propose(tokens, k) == brute_force(tokens, k, lo, hi)


@pytest.fixture(scope="module")
def engines(make_llm):
    """fp32 engines, alike but for speculation: the comparison is exact in fp32."""
    kw = dict(dtype="float32", max_num_batched_tokens=64, max_num_seqs=16)
    return make_llm(**kw), make_llm(speculative=SPEC, **kw)


def prompts(llm) -> list[list[int]]:
    chat = [llm.engine.apply_chat_template([{"role": "user", "content": c}]) for c in (
        f"Repeat this passage exactly: {PASSAGE}",
        f"Copy the text below twice.\n\n{PASSAGE}",
        "Count from one to twenty in words, separated by commas.",
        "Write a short poem about the sea.")]
    rng = random.Random(0)
    return chat + [[rng.randrange(100, 49000) for _ in range(rng.randint(5, 90))]
                   for _ in range(4)]


SEEDED = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=24, ignore_eos=True)


def rows(llm) -> list[tuple[list[int], SamplingParams]]:
    """One batch of every kind of request: each end condition (max_tokens past EOS, a
    stop string, a max_tokens that cuts the drafts, EOS) and logprobs on the repeating
    prompts, where drafts are accepted, and on the others; seeded sampling."""
    repeat, copy, count, poem, *rand = prompts(llm)
    # No more tokens than each needs (every one more is a step over the whole model): 36
    # go past the repeating prompts' EOS (their 32nd and 34th tokens), and they reach
    # "fox runs" at their 21st.
    past_eos, stop = greedy(36, ignore_eos=True), greedy(24, stop=["fox runs"])
    short, logprobs = greedy(7), greedy(24, logprobs=2)
    return [(repeat, past_eos), (copy, past_eos),  # first: the prefix-cache test's rows
            (repeat, stop), (copy, stop), (repeat, short), (copy, logprobs),
            (count, logprobs), (poem, stop),
            (rand[0], past_eos), (rand[1], stop), (rand[2], short), (rand[3], logprobs),
            (repeat, SEEDED), (copy, SEEDED)]


DRAFTING = range(6)  # the rows of the repeating prompts, greedy: each must accept drafts


def run_rows(llm, batch):
    """Run (prompt, params) rows as one batch; return their final outputs in order and,
    per row, the most tokens one step gave it (more than one: drafts were accepted)."""
    ids = [llm.engine.add_request(p, sp) for p, sp in batch]
    per_req, _ = run_steps(llm.engine)
    return ([per_req[i][-1] for i in ids],
            [max(len(o.new_token_ids) for o in per_req[i]) for i in ids])


@pytest.fixture(scope="module")
def runs(engines):
    """The batch run once on each engine (what the tests below compare), and the spec
    engine's counters over it."""
    plain, spec = engines
    batch = rows(plain)
    ref, _ = run_rows(plain, batch)
    got, most = run_rows(spec, batch)
    return SimpleNamespace(batch=batch, ref=ref, got=got, most=most, stats=spec.engine.stats())


@pytest.mark.slow
def test_greedy_with_drafts_equals_greedy_without(runs):
    for (_, p), r, g in zip(runs.batch, runs.ref, runs.got, strict=True):
        assert g.token_ids == r.token_ids, p
        assert g.text == r.text and g.finish_reason == r.finish_reason
        assert g.stop_reason == r.stop_reason
        if p.logprobs is not None:
            # Same tokens and top ids; the values agree to fp32 rounding (a draft
            # position's logits come from a multi-token pass).
            for lg, lr in zip(g.logprobs, r.logprobs, strict=True):
                assert list(lg) == list(lr)
                assert all(abs(lg[t] - lr[t]) < 1e-3 for t in lg)
    # Each end condition was met (so each was met with drafts in flight).
    reasons = {(r.finish_reason, r.stop_reason) for r in runs.ref}
    assert {("length", None), ("stop", "fox runs"), ("stop", None)} <= reasons, reasons
    assert len(runs.ref[4].token_ids) == 7
    for i in DRAFTING:
        assert runs.most[i] > 1, f"row {i} of the repeating prompts accepted no draft"
    s = runs.stats
    assert 0 < s.num_spec_accepted_tokens <= s.num_spec_draft_tokens
    assert s.spec_mean_accepted_length > 1.5


@pytest.mark.slow
def test_the_same_with_a_prefix_cache_hit_and_with_a_tiny_budget(engines, runs, make_llm):
    """Drafts after a cached prefix (the batch above left the prompts in the cache); and
    a budget so short (6 tokens for 2 requests) that drafts are cut to fit."""
    _, spec = engines
    ps = [p for p, _ in runs.batch[:2]]
    # Greedy: the first 24 tokens are the reference's first 24.
    params, ref = greedy(24, ignore_eos=True), [o.token_ids[:24] for o in runs.ref[:2]]
    before = spec.engine.stats().num_spec_accepted_tokens
    again = spec.generate(ps, params)
    assert all(o.num_cached_tokens > 0 for o in again)
    assert [o.token_ids for o in again] == ref
    assert spec.engine.stats().num_spec_accepted_tokens > before
    tight = make_llm(dtype="float32", max_num_batched_tokens=6, max_num_seqs=4,
                     speculative=SPEC)
    assert [o.token_ids for o in tight.generate(ps, params)] == ref
    assert tight.engine.stats().num_spec_accepted_tokens > 0
    assert_idle(tight)


@pytest.mark.slow
def test_the_same_under_preemption(runs, make_llm):
    """A pool of 11 usable blocks for 2 requests of 7 blocks each (prompts of 66 and 69
    tokens, 36 more each), which share their chat template's first block: they preempt
    each other, and a preempted request drops its drafts and recomputes."""
    ps, params = [p for p, _ in runs.batch[:2]], runs.batch[0][1]
    small = make_llm(dtype="float32", kv_cache_gib=0.0085, max_model_len=128,
                     max_num_batched_tokens=64, speculative=SPEC)
    got = small.generate(ps, params)
    assert small.engine.stats().num_preemptions > 0
    assert small.engine.stats().num_spec_accepted_tokens > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in runs.ref[:2]]
    assert_idle(small)


@pytest.mark.slow
def test_no_drafts_above_the_batch_size_threshold(make_llm):
    llm = make_llm(dtype="float32", speculative=SpecConfig(method="ngram",
                                                            disable_batch_size=2))
    ps = prompts(llm)[:2]
    llm.generate(ps, greedy(8, ignore_eos=True))
    drafts = llm.engine.stats().num_spec_drafts
    assert drafts > 0  # two decodes: at the threshold, they draft
    llm.generate(prompts(llm)[:3], greedy(8, ignore_eos=True))
    # Three at once draft only once one has finished... they all end together: never.
    assert llm.engine.stats().num_spec_drafts == drafts
    assert_idle(llm)


@pytest.mark.slow
def test_seeded_sampling_is_the_same_with_and_without_drafts(runs):
    """A seeded random request never drafts: its generator's stream stays the one a
    migration replays."""
    seeded = [i for i, (_, p) in enumerate(runs.batch) if p is SEEDED]
    assert len(seeded) == 2
    for i in seeded:
        assert runs.got[i].token_ids == runs.ref[i].token_ids
        assert runs.most[i] == 1, "a seeded request took a draft"


# ---- the rejection sampler ----------------------------------------------------------

def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution the sampler must produce, computed independently: temperature,
    then keep the top-k, then the smallest top-p set."""
    z = logits.double() / params.temperature
    p = torch.softmax(z, dim=-1)
    order = torch.argsort(p, descending=True)
    keep = torch.zeros_like(p, dtype=torch.bool)
    mass = 0.0
    for rank, i in enumerate(order.tolist()):
        if (params.top_k != -1 and rank >= params.top_k) or mass >= params.top_p:
            break
        keep[i] = True
        mass += p[i].item()
    q = torch.where(keep, p, 0.0)
    return q / q.sum()


@pytest.mark.parametrize("params,draft", [
    (SamplingParams(temperature=1.0), 2),  # a likely draft
    (SamplingParams(temperature=1.0), 7),  # an unlikely one
    (SamplingParams(temperature=0.7, top_k=5), 0),
    (SamplingParams(temperature=1.3, top_p=0.8), 6),  # the draft is filtered out
])
def test_rejection_sampling_keeps_the_target_distribution(params, draft):
    """Each verified row emits the draft if accepted, else its residual draw: over many
    rows the emitted tokens must follow the target distribution (a chi-square test at
    a false-alarm rate of about 1e-6), whatever the draft."""
    torch.manual_seed(0)
    logits = torch.tensor([1.0, 0.5, 2.0, -1.0, 0.0, 1.5, -0.5, -2.0])
    n = 40_000
    rows = [SamplingRow(params, None, [1], [], draft)] * n
    sampler = Sampler(torch.Generator().manual_seed(1))
    out = sampler(logits.expand(n, -1).clone(), rows)
    emitted = torch.tensor(out.token_ids)
    counts = torch.bincount(emitted, minlength=8).double()
    p = target_probs(logits, params)
    assert (counts[p == 0] == 0).all(), "a filtered token was emitted"
    expected = p * n
    live = expected > 0
    chi2 = (((counts - expected) ** 2)[live] / expected[live]).sum().item()
    dof = int(live.sum()) - 1
    # chi-square quantile at 1 - 1e-6 for <= 7 degrees of freedom is below 42.
    assert chi2 < 42, (chi2, dof, counts.tolist(), expected.tolist())
    # The accepted share is p(draft): the draft is emitted exactly when accepted or
    # when the residual... never (the residual excludes it).
    acc = torch.tensor(out.accepted).double().mean().item()
    assert abs(acc - p[draft].item()) < 5 * (p[draft].item() * (1 - p[draft].item()) / n
                                              ) ** 0.5 + 1e-9
    assert ((emitted == draft) == torch.tensor(out.accepted)).all()


def test_greedy_verification_accepts_exactly_the_argmax():
    logits = torch.tensor([[0.1, 3.0, 0.2], [0.1, 3.0, 0.2], [5.0, 0.0, 0.0]])
    rows = [SamplingRow(greedy(), None, [0], [], d) for d in (1, 2, None)]
    out = Sampler()(logits, rows)
    assert out.token_ids == [1, 1, 0] and out.accepted == [True, False, False]

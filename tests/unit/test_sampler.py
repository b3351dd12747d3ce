"""Sampler checked against references: argmax, softmax frequencies, loop-based penalties."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from baton.services.common.sampling_params import SamplingParams
from baton.services.engine.sampler import Sampler, SamplingRow, apply_penalties, banned_ids


def row(seed: int | None = None, prompt=(), output=(), **kw) -> SamplingRow:
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return SamplingRow(SamplingParams(seed=seed, **kw), gen, list(prompt), list(output))


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- greedy ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax(dtype):
    logits = torch.randn(6, 300, generator=gen(1)).to(dtype)
    out = Sampler(gen())(logits, [row(temperature=0.0) for _ in range(6)])
    assert out.token_ids == logits.float().argmax(-1).tolist()
    assert out.logprobs is None and out.top_logprobs is None


def test_greedy_rows_unaffected_by_other_rows_and_use_no_rng():
    logits = torch.randn(5, 100, generator=gen(2))
    g = gen(3)
    state = g.get_state()
    greedy_seeded = row(seed=9, temperature=0.0)
    seeded_state = greedy_seeded.generator.get_state()
    rows = [row(temperature=0.0), row(temperature=1.0), greedy_seeded,
            row(temperature=0.7, top_k=5, repetition_penalty=1.3, output=[1, 2]),
            row(temperature=0.0, logprobs=2)]
    out = Sampler(g)(logits, rows)
    ref = logits.argmax(-1)
    for i in (0, 2, 4):
        assert out.token_ids[i] == ref[i].item()
    # Only the one unseeded random row draws; a greedy row never touches its own generator.
    assert torch.equal(greedy_seeded.generator.get_state(), seeded_state)
    g2 = gen(3)
    Sampler(g2)(logits[:2], [row(temperature=0.0), row(temperature=0.0, logprobs=1)])
    assert torch.equal(g2.get_state(), state)


@pytest.mark.parametrize("kw", [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}])
def test_degenerate_filters_equal_greedy(kw):
    logits = torch.randn(64, 1000, generator=gen(4)) * 3
    out = Sampler(gen(5))(logits, [row(temperature=1.0, **kw) for _ in range(64)])
    assert out.token_ids == logits.argmax(-1).tolist()


# --- distributions --------------------------------------------------------------------------

# Probabilities in a shuffled vocab order, so a filter that forgets to unsort shows up.
_PROBS = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.015, 0.005])
_PERM = torch.tensor([5, 2, 7, 0, 3, 6, 1, 4])  # token _PERM[r] has the r-th largest prob
_N = 20000


def _freqs(rows_kw: dict, seed: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample _N rows of the fixed logits; return (empirical freqs, softmax probs) by token."""
    logits = torch.empty(8)
    logits[_PERM] = _PROBS.log() + 1.234  # an offset: softmax must not care
    rows = [row(**rows_kw)] * _N  # unseeded rows share nothing but the sampler's RNG
    out = Sampler(gen(seed))(logits.expand(_N, 8), rows)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=8).float()
    return counts / _N, logits.softmax(-1)


def _assert_close(freq: torch.Tensor, probs: torch.Tensor) -> None:
    # Binomial std <= sqrt(0.25 / 20000) ~ 0.0035; 0.015 is > 4 sigma.
    assert torch.allclose(freq, probs, atol=0.015), (freq, probs)


def test_temperature_one_matches_softmax():
    freq, probs = _freqs({"temperature": 1.0})
    _assert_close(freq, probs)


def test_temperature_scales_logits():
    logits = torch.empty(8)
    logits[_PERM] = _PROBS.log()
    freq, _ = _freqs({"temperature": 0.5})
    _assert_close(freq, (logits / 0.5).softmax(-1))


def _renorm(probs: torch.Tensor, keep: list[int]) -> torch.Tensor:
    ref = torch.zeros(8)
    ref[keep] = probs[keep] / probs[keep].sum()
    return ref


def test_top_k_keeps_only_top_k():
    freq, probs = _freqs({"temperature": 1.0, "top_k": 3})
    keep = _PERM[:3].tolist()
    assert set(torch.nonzero(freq).flatten().tolist()) == set(keep)
    _assert_close(freq, _renorm(probs, keep))


@pytest.mark.parametrize("top_p, n_keep", [(0.3, 1), (0.5, 2), (0.7, 3), (0.9, 4), (0.96, 6)])
def test_top_p_samples_exactly_the_nucleus(top_p, n_keep):
    # Cumulative mass 0.4, 0.65, 0.8, 0.9, 0.95, 0.98, ...: the smallest prefix reaching top_p.
    freq, probs = _freqs({"temperature": 1.0, "top_p": top_p})
    keep = _PERM[:n_keep].tolist()
    assert set(torch.nonzero(freq).flatten().tolist()) == set(keep)
    _assert_close(freq, _renorm(probs, keep))


def test_min_p_drops_tokens_below_fraction_of_max():
    # Threshold 0.3 * 0.4 = 0.12 keeps the tokens with p 0.4, 0.25, 0.15.
    freq, probs = _freqs({"temperature": 1.0, "min_p": 0.3})
    keep = _PERM[:3].tolist()
    assert set(torch.nonzero(freq).flatten().tolist()) == set(keep)
    _assert_close(freq, _renorm(probs, keep))


def test_top_k_and_top_p_combine():
    # top_k 4 renormalizes to 0.444, 0.278, ...; top_p 0.6 then needs the top two.
    freq, probs = _freqs({"temperature": 1.0, "top_k": 4, "top_p": 0.6})
    keep = _PERM[:2].tolist()
    assert set(torch.nonzero(freq).flatten().tolist()) == set(keep)
    _assert_close(freq, _renorm(probs, keep))


# --- seeds ----------------------------------------------------------------------------------


def _seeded_run(seed: int, position: int, others: int, steps: int = 12) -> list[int]:
    """Tokens of one seeded row over `steps` calls, sitting at `position` among other rows."""
    v = 500
    target = row(seed=seed, temperature=1.0, top_p=0.9)
    others_rows = [row(seed=100 + j if j % 2 else None, temperature=0.8 + 0.1 * j,
                       top_k=50 if j % 3 == 0 else -1) for j in range(others)]
    sampler = Sampler(gen(position * 7 + others))
    fixed = torch.randn(steps, v, generator=gen(21)) * 2  # the seeded row's logits per step
    noise = gen(1000 + position)
    toks = []
    for s in range(steps):
        batch = torch.randn(others + 1, v, generator=noise)
        batch[position] = fixed[s]
        rows = others_rows[:position] + [target] + others_rows[position:]
        toks.append(sampler(batch, rows).token_ids[position])
    return toks


def test_seed_is_batch_invariant():
    alone = _seeded_run(seed=7, position=0, others=0)
    assert _seeded_run(seed=7, position=2, others=5) == alone
    assert _seeded_run(seed=7, position=4, others=4) == alone


def test_different_seeds_differ():
    assert _seeded_run(seed=7, position=0, others=0) != _seeded_run(seed=8, position=0, others=0)


# --- penalties ------------------------------------------------------------------------------


def _ref_penalties(logits: torch.Tensor, r: SamplingRow) -> torch.Tensor:
    out = logits.clone().tolist()
    p = r.params
    for t in set(r.prompt_token_ids) | set(r.output_token_ids):
        out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t, c in Counter(r.output_token_ids).items():
        out[t] -= p.frequency_penalty * c + p.presence_penalty
    return torch.tensor(out)


def _penalty_rows(v: int) -> list[SamplingRow]:
    g = torch.Generator().manual_seed(31)

    def toks(n: int) -> list[int]:
        return torch.randint(0, 20, (n,), generator=g).tolist()  # small range: repeats

    return [
        row(temperature=0.0, prompt=toks(15), output=toks(10), repetition_penalty=1.5),
        row(temperature=0.0, prompt=toks(3), output=toks(25), presence_penalty=0.7),
        row(temperature=0.0, prompt=toks(8), output=toks(12), frequency_penalty=1.1),
        row(temperature=0.0, prompt=toks(5), output=toks(30), repetition_penalty=0.8,
            presence_penalty=-0.5, frequency_penalty=0.9),
        row(temperature=0.0, prompt=toks(9), output=toks(9)),  # no penalties: untouched
        row(temperature=0.0, prompt=toks(4), output=[], repetition_penalty=2.0,
            frequency_penalty=2.0),
        row(temperature=0.0, prompt=[], output=[v - 1] * 4, frequency_penalty=0.3),
    ]


def test_penalties_match_reference():
    v = 40
    rows = _penalty_rows(v)
    logits = torch.randn(len(rows), v, generator=gen(32)) * 2
    got = apply_penalties(logits, rows)
    ref = torch.stack([_ref_penalties(logits[i], r) for i, r in enumerate(rows)])
    torch.testing.assert_close(got, ref)
    assert torch.equal(got[4], logits[4])
    assert not torch.equal(got, logits)


def test_penalties_steer_greedy_choice():
    v = 40
    rows = _penalty_rows(v)
    logits = torch.randn(len(rows), v, generator=gen(33))
    # Make the most repeated output token of each penalized row the raw argmax.
    for i, r in enumerate(rows[:4]):
        logits[i, Counter(r.output_token_ids).most_common(1)[0][0]] = 2.5
    out = Sampler(gen())(logits, rows)
    ref = [int(_ref_penalties(logits[i], r).argmax()) for i, r in enumerate(rows)]
    assert out.token_ids == ref
    assert out.token_ids[:4] != logits[:4].argmax(-1).tolist()


# --- logit bias and bans -------------------------------------------------------------------


def test_logit_bias_is_added_before_greedy_and_logprobs_stay_raw():
    logits = torch.randn(3, 50, generator=gen(61))
    top = int(logits[0].argmax())
    bias = {3: 5.0, 10: -100.0, top: -3.5}
    rows = [row(temperature=0.0, logit_bias=bias, logprobs=1), row(temperature=0.0),
            row(seed=1, temperature=1.0, logit_bias={7: 100.0})]
    out = Sampler(gen())(logits, rows)
    ref = logits[0].clone()
    for t, b in bias.items():
        ref[t] += b
    assert out.token_ids == [int(ref.argmax()), int(logits[1].argmax()), 7]
    assert out.token_ids[0] != top
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[0] == pytest.approx(raw[0, out.token_ids[0]].item(), abs=1e-5)
    assert out.top_logprobs[0][0][0] == top  # the raw distribution's best, not the bias's


def test_logit_bias_samples_softmax_of_biased_logits():
    bias = {int(_PERM[0]): -1.0, int(_PERM[7]): 2.0}
    freq, probs = _freqs({"temperature": 1.0, "logit_bias": bias})
    shift = torch.zeros(8)
    for t, b in bias.items():
        shift[t] = b
    _assert_close(freq, (probs.log() + shift).softmax(-1))


def test_min_tokens_bans_stop_ids_until_reached_and_bad_words_by_their_prefix():
    stops = frozenset({4, 9})

    def banned(out, min_tokens=0, words=()):
        r = SamplingRow(SamplingParams(max_tokens=20, min_tokens=min_tokens), None, [],
                        list(out), None, stops, words)
        return sorted(banned_ids(r))

    assert banned([1, 2], min_tokens=3) == [4, 9]
    assert banned([1, 2, 3], min_tokens=3) == []  # the 4th token may stop
    words = ((5,), (6, 7), (1, 2, 8))
    assert banned([], words=words) == [5]  # one token: always; longer: not yet
    assert banned([3, 6], words=words) == [5, 7]
    assert banned([1, 2], words=words) == [5, 8]
    assert banned([2, 2], words=words) == [5]
    assert banned([6], min_tokens=2, words=words) == [4, 5, 7, 9]


def test_bans_are_minus_inf_unless_they_would_leave_no_token():
    logits = torch.randn(3, 6, generator=gen(62))
    logits[1, :5] = float("-inf")  # a constraint that allows only token 5 (EOS, say)
    logits[2, :] = 0.0
    eos = frozenset({5})
    rows = [SamplingRow(SamplingParams(temperature=0.0, min_tokens=2), None, [], [], None,
                        frozenset({int(logits[0].argmax())})),
            SamplingRow(SamplingParams(temperature=0.0, min_tokens=2), None, [], [], None, eos),
            SamplingRow(SamplingParams(temperature=0.0), None, [], [0], None, frozenset(),
                        ((0, 1), (2,), (0, 3), (0, 4), (5,)))]
    out = Sampler(gen())(logits, rows)
    assert out.token_ids[0] == int(logits[0].topk(2).indices[1])  # the runner-up
    assert out.token_ids[1] == 5  # nothing else: the ban is off, the constraint ends it
    assert out.token_ids[2] == 0  # 1..5 banned: 0 is left


# --- logprobs -------------------------------------------------------------------------------


def test_logprobs_are_raw_and_top_n_match_topk():
    v = 200
    logits = (torch.randn(5, v, generator=gen(41)) * 3).to(torch.bfloat16)
    rows = [row(temperature=1.0, logprobs=5),
            row(temperature=0.0, logprobs=0),
            row(temperature=0.5, top_k=10, logprobs=20, repetition_penalty=1.5,
                output=[0, 1, 2]),
            row(temperature=1.0),
            row(seed=3, temperature=0.0, frequency_penalty=2.0, output=[7, 7], logprobs=3)]
    out = Sampler(gen(42))(logits, rows)
    ref = torch.log_softmax(logits.float(), dim=-1)
    assert out.logprobs is not None and out.top_logprobs is not None
    for i, r in enumerate(rows):
        assert out.logprobs[i] == pytest.approx(ref[i, out.token_ids[i]].item(), abs=1e-5)
        n = r.params.logprobs or 0
        top = out.top_logprobs[i]
        assert len(top) == n
        vals = [lp for _, lp in top]
        assert vals == sorted(vals, reverse=True)
        if n:
            tv, ti = torch.topk(ref[i], n)
            torch.testing.assert_close(torch.tensor(vals), tv)
            # Ties in bf16 logits may order differently; compare ids by their logprobs.
            torch.testing.assert_close(ref[i, [t for t, _ in top]], tv)
            assert len({t for t, _ in top}) == n


# --- device ---------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no CUDA device: the GPU sampling path needs one")
def test_cuda_matches_cpu_with_cpu_generators():
    logits = torch.randn(4, 1000, generator=gen(51))
    rows = lambda: [row(seed=5, temperature=0.9, top_p=0.8), row(temperature=0.0),  # noqa: E731
                    row(seed=6, temperature=1.2, top_k=40, logprobs=4),
                    row(seed=8, temperature=1.0, repetition_penalty=1.2, output=[3, 4])]
    cpu = Sampler()(logits, rows())
    cuda = Sampler()(logits.cuda(), rows())
    assert cuda.token_ids == cpu.token_ids
    assert cuda.logprobs == pytest.approx(cpu.logprobs, abs=1e-4)


def _mixed_rows():
    return [row(temperature=0.0, logit_bias={3: 2.0}),
            row(seed=5, temperature=0.9, top_p=0.8, min_p=0.05),
            SamplingRow(SamplingParams(temperature=0.7, top_k=20, logprobs=3, min_tokens=4),
                        None, [], [1], None, frozenset({2}), ((1, 5), (6,))),
            row(seed=8, temperature=1.0, repetition_penalty=1.2, presence_penalty=0.5,
                frequency_penalty=0.3, prompt=[1, 2], output=[3, 4, 4])]


def test_sample_reads_no_device_value():
    """`Sampler.sample` must not read device values on the host: on CUDA that is a sync
    that stalls the step. Meta tensors have no values, so any such read raises here."""
    logits = torch.empty(4, 1000, device="meta")
    packed = Sampler(None).sample(logits, _mixed_rows())
    assert packed.device.type == "meta" and packed.shape == (4, 2 + 2 * 3)
    greedy = Sampler(None).sample(logits, [row(temperature=0.0)] * 4)
    assert greedy.shape == (4,) and greedy.dtype == torch.long


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no CUDA device: CUDA's sync debug mode needs one")
def test_sample_makes_no_cuda_sync():
    logits = torch.randn(4, 1000, device="cuda")
    sampler = Sampler(torch.Generator(device="cuda").manual_seed(0))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        sampler.sample(logits, _mixed_rows())
    finally:
        torch.cuda.set_sync_debug_mode("default")

"""Turn one step's logits into tokens: penalties, logit bias and bans (min_tokens,
bad_words), temperature, top-k/top-p/min-p, sampling.

No host syncs: `Sampler.sample` reads no device value on the host (every decision it makes
comes from the rows' parameters, which live on the host), and host data reaches the device
only through pinned, non-blocking copies. The step's one device-to-host transfer is the
`.tolist()` in `Sampler.__call__`, which the scheduler needs anyway.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..common.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """One row of the batch that samples this step."""

    params: SamplingParams
    generator: torch.Generator | None  # per-request generator when params.seed is set
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # for a draft position, with the drafts before it
    draft_token: int | None = None  # the draft token this row verifies (spec decoding)
    # Banned while output_token_ids is shorter than params.min_tokens: EOS and stop ids.
    stop_ids: frozenset[int] = frozenset()
    # bad_words as token ids: the last id is banned where the output ends with the others.
    bad_words: tuple[tuple[int, ...], ...] = ()


@dataclass
class SamplerOutput:
    token_ids: list[int]  # sampled token per row (a verified row: the draft if accepted)
    accepted: list[bool] | None  # per row, whether its draft was accepted; None: no drafts
    logprobs: list[float] | None  # raw logprob of the sampled token per row; None if no row asked
    top_logprobs: list[list[tuple[int, float]]] | None  # per row top-N (id, logprob); [] if unasked


def to_device(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list (or CPU tensor) on `device` without a sync: on CUDA it is staged in
    pinned memory and copied asynchronously (a pageable copy would wait for the stream)."""
    t = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _padded(seqs: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max((len(s) for s in seqs), default=0)
    rows = [s + [pad] * (width - len(s)) for s in seqs]
    return to_device(rows, torch.long, device).reshape(len(seqs), width)


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Return penalized float32 logits (out of place); rows without penalties are unchanged."""
    b, v = logits.shape
    dev = logits.device
    out = logits.float()
    # Token ids padded with v land in a spare column v that is dropped: one scatter per batch.
    reps = [r.params.repetition_penalty for r in rows]
    if any(p != 1.0 for p in reps):
        seen_tok = _padded([r.prompt_token_ids + r.output_token_ids if p != 1.0 else []
                            for r, p in zip(rows, reps, strict=True)], v, dev)
        seen = torch.zeros(b, v + 1, dtype=torch.bool, device=dev)
        seen = seen.scatter(1, seen_tok, True)[:, :v]
        rep = to_device(reps, torch.float32, dev)[:, None]
        # HF: a seen token's logit moves towards "less likely" whatever its sign.
        out = torch.where(seen, torch.where(out > 0, out / rep, out * rep), out)
    pres = [r.params.presence_penalty for r in rows]
    freq = [r.params.frequency_penalty for r in rows]
    if any(p != 0.0 or f != 0.0 for p, f in zip(pres, freq, strict=True)):
        out_tok = _padded([r.output_token_ids if (p != 0.0 or f != 0.0) else []
                           for r, p, f in zip(rows, pres, freq, strict=True)], v, dev)
        counts = torch.zeros(b, v + 1, dtype=torch.float32, device=dev)
        counts = counts.scatter_add(1, out_tok, torch.ones_like(out_tok, dtype=torch.float32))
        counts = counts[:, :v]
        pres_t = to_device(pres, torch.float32, dev)[:, None]
        freq_t = to_device(freq, torch.float32, dev)[:, None]
        # OpenAI: logit -= frequency * count + presence * (count > 0), output tokens only.
        out = out - freq_t * counts - pres_t * (counts > 0).float()
    return out


def bad_words_ids(tokenizer, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    """Each word's token ids as written (leading spaces dropped) and with one leading
    space, the way it reads mid-sentence (" refers" is one token where "refers" is two).
    The spaced form is left out where it is the plain one after a token of its own for
    the space: the plain form bans that already."""
    seqs: dict[tuple[int, ...], None] = {}
    for word in words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        seqs[plain] = None
        if spaced[1:] != plain:
            seqs[spaced] = None
    return tuple(s for s in seqs if s)


def banned_ids(r: SamplingRow) -> list[int]:
    """The ids this row may not sample: stop ids under min_tokens, and the bad words
    whose other tokens the output ends with."""
    out = r.output_token_ids
    banned = list(r.stop_ids) if len(out) < r.params.min_tokens else []
    for word in r.bad_words:
        k = len(word) - 1
        # The last token first: most words fail there, without a slice.
        if k == 0 or (k <= len(out) and out[-1] == word[-2] and out[-k:] == list(word[:-1])):
            banned.append(word[-1])
    return banned


def apply_bias_and_bans(scores: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """logit_bias added, and banned ids (`banned_ids`) set to -inf, out of place: `scores`
    (maybe the raw logits, which logprobs read) is never written. A row where the bans
    would leave no token at all (a constraint that allows only EOS under min_tokens)
    keeps its bans off: the constraint then ends the request. Ids outside the logits
    (a stop id past the vocabulary) are skipped."""
    b, v = scores.shape
    bias_at: tuple[list[int], list[int]] = ([], [])
    bias: list[float] = []
    ban_at: tuple[list[int], list[int]] = ([], [])
    for i, r in enumerate(rows):
        for t, x in r.params.logit_bias:
            if t < v:
                bias_at[0].append(i)
                bias_at[1].append(t)
                bias.append(x)
        for t in banned_ids(r):
            if 0 <= t < v:
                ban_at[0].append(i)
                ban_at[1].append(t)
    if not bias and not ban_at[0]:
        return scores
    dev = scores.device
    out = scores.float()
    if bias:
        idx = tuple(to_device(a, torch.long, dev) for a in bias_at)
        out = out.index_put(idx, to_device(bias, torch.float32, dev), accumulate=True)
    if ban_at[0]:
        idx = tuple(to_device(a, torch.long, dev) for a in ban_at)
        ban = torch.zeros(b, v, dtype=torch.bool, device=dev).index_put(
            idx, torch.ones((), dtype=torch.bool, device=dev))
        banned = out.masked_fill(ban, float("-inf"))
        nothing_left = banned.isneginf().all(dim=-1, keepdim=True)
        out = torch.where(nothing_left, out, banned)
    return out


def apply_filters(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, top-p, min-p; dropped tokens get -inf. Rows must not be greedy."""
    b, v = logits.shape
    dev = logits.device
    temp = to_device([p.temperature for p in params], torch.float32, dev)
    out = logits / temp[:, None]
    use_k = any(p.top_k != -1 for p in params)
    use_p = any(p.top_p < 1.0 for p in params)
    if use_k or use_p:
        # One descending sort for the whole batch serves both filters.
        srt, idx = out.sort(dim=-1, descending=True)
        if use_k:
            k = to_device([p.top_k if p.top_k != -1 else v for p in params], torch.long, dev)
            srt = srt.masked_fill(torch.arange(v, device=dev)[None, :] >= k[:, None],
                                  float("-inf"))
        if use_p:
            # Keep the smallest prefix whose mass reaches top_p: a token stays iff the mass
            # strictly before it is < top_p (the first token always stays). top_p 1 -> inf,
            # so rounding in the cumulative sum can never drop a tail token.
            top_p = to_device([p.top_p if p.top_p < 1.0 else float("inf") for p in params],
                              torch.float32, dev)
            probs = srt.softmax(dim=-1)
            before = probs.cumsum(dim=-1) - probs
            srt = srt.masked_fill(before >= top_p[:, None], float("-inf"))
        out = torch.full_like(out, float("-inf")).scatter(1, idx, srt)
    if any(p.min_p > 0.0 for p in params):
        min_p = to_device([p.min_p for p in params], torch.float32, dev)
        probs = out.softmax(dim=-1)
        # p_i < min_p * p_max; the ratio is the same before or after renormalizing.
        thresh = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        out = out.masked_fill(probs < thresh, float("-inf"))
    return out


class Sampler:
    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator  # for rows without a seed; None = torch's default RNG

    @staticmethod
    def advance(generator: torch.Generator, vocab_size: int, num_tokens: int) -> None:
        """Bring a seeded generator to where it would be after this sampler had drawn
        `num_tokens` tokens with it (another engine drew them: a migration, or a prefill
        worker's first token). Each draw of a seeded row is one vector in `_noise`."""
        for _ in range(num_tokens):
            torch.empty(vocab_size, device=generator.device).exponential_(generator=generator)

    def _noise(self, rows: list[SamplingRow], v: int, device: torch.device) -> torch.Tensor:
        """Exponential(1) noise [len(rows), V]; a seeded row's draw uses only its generator."""
        # A generator can only fill a tensor on its own device, so a CPU generator with CUDA
        # logits draws on CPU and the result is copied over (pinned, asynchronous).
        shared = self.generator
        shared_dev = shared.device if shared is not None else device
        unseeded = [i for i, r in enumerate(rows) if r.generator is None]
        parts: list[torch.Tensor | None] = [None] * len(rows)
        if unseeded:
            block = torch.empty(len(unseeded), v, device=shared_dev).exponential_(generator=shared)
            for j, i in enumerate(unseeded):
                parts[i] = block[j]
        for i, r in enumerate(rows):
            if r.generator is not None:
                g = r.generator
                parts[i] = torch.empty(v, device=g.device).exponential_(generator=g)
        q = torch.stack([p if p.device == device else to_device(p, p.dtype, device)
                         for p in parts if p is not None])
        return q.clamp_min_(torch.finfo(torch.float32).tiny)  # a 0 draw would make 0/0

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """This step's tokens, on the logits' device, without reading any device value.

        Without drafts or logprobs: token ids [B] (long). Otherwise one float64 tensor
        [B, C]: the token id; with drafts, 1.0 where the row's draft was accepted; with
        logprobs, the token's logprob, the top n_max ids and their logprobs (ids below
        2**53 are exact in float64), so that one transfer brings everything over.

        A row with a draft token d verifies it (speculative decoding; the proposer is
        deterministic, so the draft distribution q is one-hot at d): greedy, d is
        accepted iff it is the argmax. Otherwise d is accepted with probability
        min(1, p(d) / q(d)) = p(d), and a rejected row draws from the residual
        max(0, p - q) renormalized, which is p without d. Either way each emitted token
        has exactly the target distribution p (rejection sampling, Leviathan et al.).
        """
        assert logits.dim() == 2 and logits.shape[0] == len(rows), "one logits row per row"
        want_n = [r.params.logprobs for r in rows]
        any_pen = any(r.params.has_penalties for r in rows)
        random_idx = [i for i, r in enumerate(rows) if not r.params.greedy]
        drafts = [r.draft_token for r in rows]
        any_draft = any(d is not None for d in drafts)
        b, v = logits.shape
        dev = logits.device
        raw = logits.float() if random_idx or any_pen else logits
        scores = apply_penalties(raw, rows) if any_pen else raw
        scores = apply_bias_and_bans(scores, rows)
        if len(random_idx) == b:
            sampled = torch.empty(b, dtype=torch.long, device=dev)
        else:
            sampled = scores.argmax(dim=-1)  # greedy rows use no generator state
        if any_draft:
            draft_t = to_device([-1 if d is None else d for d in drafts], torch.long, dev)
            accept = sampled == draft_t  # the greedy rule; random rows are set below
        if random_idx:
            sel = to_device(random_idx, torch.long, dev)
            sub_rows = [rows[i] for i in random_idx]
            sub = scores if len(random_idx) == b else scores.index_select(0, sel)
            probs = apply_filters(sub, [r.params for r in sub_rows]).softmax(dim=-1)
            sub_drafts = [drafts[i] for i in random_idx]
            if any(d is not None for d in sub_drafts):
                d_t = to_device([0 if d is None else d for d in sub_drafts], torch.long, dev)
                has = to_device([d is not None for d in sub_drafts], torch.bool, dev)
                p_d = probs.gather(1, d_t[:, None])[:, 0]
                u = torch.rand(len(sub_rows), device=self._noise_device(dev),
                               generator=self.generator)
                u = u if u.device == dev else to_device(u, u.dtype, dev)
                acc = has & (u < p_d)
                # The residual for a rejected draft: p with d removed (not renormalized:
                # the exponential race below does not need it).
                probs = probs.scatter(1, d_t[:, None],
                                      torch.where(has[:, None], 0.0, p_d[:, None]))
            # Exponential race: argmax_i p_i / q_i with q_i ~ Exp(1) iid is a draw from p
            # (q_i / p_i ~ Exp(p_i), and the smallest of independent exponentials is i with
            # probability p_i / sum p). Filtered tokens have p = 0 and can never win.
            tok = (probs / self._noise(sub_rows, v, dev)).argmax(dim=-1)
            if any(d is not None for d in sub_drafts):
                tok = torch.where(acc, d_t, tok)
                accept = accept.index_copy(0, sel, acc)
            sampled = sampled.index_copy(0, sel, tok)
        cols = [sampled[:, None].double()]
        if any_draft:
            cols.append(accept[:, None].double())
        if any(n is not None for n in want_n):
            logp = torch.log_softmax(logits.float(), dim=-1)  # the raw model distribution
            n_max = max(n for n in want_n if n is not None)
            top_v, top_i = logp.topk(n_max, dim=-1)
            cols += [logp.gather(1, sampled[:, None]).double(), top_i.double(),
                     top_v.double()]
        return sampled if len(cols) == 1 else torch.cat(cols, dim=1)

    def _noise_device(self, device: torch.device) -> torch.device:
        return self.generator.device if self.generator is not None else device

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        host = self.sample(logits, rows).tolist()  # the step's one device->host transfer
        want_n = [r.params.logprobs for r in rows]
        any_draft = any(r.draft_token is not None for r in rows)
        if not any_draft and all(n is None for n in want_n):
            return SamplerOutput(host, None, None, None)
        accepted = [r[1] > 0.5 for r in host] if any_draft else None
        tokens = [int(r[0]) for r in host]
        if all(n is None for n in want_n):
            return SamplerOutput(tokens, accepted, None, None)
        c = 2 if any_draft else 1  # the first logprob column
        n_max = max(n for n in want_n if n is not None)
        # A token a constraint masked has logprob -inf: it is left out of the top N.
        top = [[(int(r[c + 1 + j]), r[c + 1 + n_max + j]) for j in range(n or 0)
                if math.isfinite(r[c + 1 + n_max + j])]
               for r, n in zip(host, want_n, strict=True)]
        return SamplerOutput(tokens, accepted, [r[c] for r in host], top)

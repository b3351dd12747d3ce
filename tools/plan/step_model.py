"""One engine step's time, predicted from what the step computes, fitted to a profile's
measured steps (profile.py).

A step runs entries (n, c): n new tokens of one request over c tokens already in its
KV (a decode: n = 1; a prefill chunk: n tokens after c cached or computed ones). Its time
is modelled as

    t = f(T) + k_seq * S + k_att * A / 1000

    T = sum of n       the tokens through the weights (the matmuls)
    S = the entries    per-sequence work (sampling, block tables, each attention call)
    A = sum of n * (c + (n + 1) / 2)
                       query-key pairs of attention (each new token reads its context
                       and the new tokens before it)

f is piecewise linear in T between knots (1, 2, 4, ... tokens): on a CPU a step of a few
tokens costs about what reading the weights costs, whatever T, and a long chunk grows
with T; one straight line fits neither end. The fit is least squares with every
coefficient kept at or above zero (an active set: a coefficient that comes out negative
is dropped and the rest fitted again).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

Entry = tuple[int, int]  # (new tokens, context before them)


def features(batch: list[Entry]) -> tuple[int, int, float]:
    """(T, S, A) of a step (above)."""
    total = sum(n for n, _ in batch)
    pairs = sum(n * (c + (n + 1) / 2) for n, c in batch)
    return total, len(batch), pairs / 1000.0


def knots_for(max_tokens: int) -> list[int]:
    """1, 2, 4, ... up to the first power of two at or above `max_tokens`."""
    out = [1]
    while out[-1] < max_tokens:
        out.append(out[-1] * 2)
    return out


def _hats(total: float, knots: list[int]) -> list[float]:
    """The piecewise-linear basis at `total`: weights on the two knots around it (past
    the last knot, the last segment's line goes on)."""
    w = [0.0] * len(knots)
    if total <= knots[0]:
        w[0] = 1.0
        return w
    for i in range(len(knots) - 1):
        lo, hi = knots[i], knots[i + 1]
        if total <= hi or i == len(knots) - 2:
            x = (total - lo) / (hi - lo)
            w[i], w[i + 1] = 1.0 - x, x
            return w
    return w


def _row(batch: list[Entry], knots: list[int]) -> list[float]:
    total, seqs, pairs = features(batch)
    return [*_hats(total, knots), float(seqs), pairs]


def _nonneg_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            return coef
        active = [a for a, s in zip(active, sol, strict=True) if s >= 0]
    return coef


@dataclass(frozen=True)
class StepModel:
    knots: tuple[int, ...]
    f: tuple[float, ...]  # seconds at each knot
    k_seq: float
    k_att: float

    def predict(self, batch: list[Entry]) -> float:
        """Seconds for one step that runs `batch`; 0 for an empty one."""
        if not batch:
            return 0.0
        total, seqs, pairs = features(batch)
        base = float(np.dot(_hats(total, list(self.knots)), self.f))
        return max(base, 0.0) + self.k_seq * seqs + self.k_att * pairs

    @classmethod
    def fit(cls, samples: list[tuple[list[Entry], float]]) -> StepModel:
        """From measured (batch, seconds) samples; ValueError with too few."""
        if len(samples) < 4:
            raise ValueError(f"a step model needs at least 4 measured steps, got {len(samples)}")
        knots = knots_for(max(features(b)[0] for b, _ in samples))
        x = np.array([_row(b, knots) for b, _ in samples])
        y = np.array([t for _, t in samples])
        # Knots no sample is near have no data: they take their neighbours' line, so each
        # is tied to the samples around it (a knot with no weight in any row is dropped
        # from the fit and filled in after).
        used = x[:, :len(knots)].sum(axis=0) > 0
        cols = [i for i in range(len(knots)) if used[i]] + [len(knots), len(knots) + 1]
        coef = np.zeros(x.shape[1])
        coef[cols] = _nonneg_lstsq(x[:, cols], y)
        f = np.interp(np.arange(len(knots)), np.flatnonzero(used), coef[:len(knots)][used])
        return cls(tuple(knots), tuple(float(v) for v in f), float(coef[-2]),
                   float(coef[-1]))

    def to_json(self) -> dict:
        return {"knots": list(self.knots), "f": list(self.f), "k_seq": self.k_seq,
                "k_att": self.k_att}

    @classmethod
    def from_json(cls, d: dict) -> StepModel:
        return cls(tuple(d["knots"]), tuple(d["f"]), d["k_seq"], d["k_att"])

    @classmethod
    def constant(cls, prefill_s_per_token: float, decode_step_s: float) -> StepModel:
        """A hand-made model (tests): every step costs `decode_step_s` plus
        `prefill_s_per_token` per token past the first, and nothing else."""
        knots = (1, 2)
        return cls(knots, (decode_step_s, decode_step_s + prefill_s_per_token), 0.0, 0.0)


def fit_error(model: StepModel, samples: list[tuple[list[Entry], float]]) -> dict:
    """How far the model lands from its own samples: the median and 90th percentile of
    |predicted - measured| / measured."""
    errs = [abs(model.predict(b) - t) / t for b, t in samples if t > 0]
    return {"median": float(np.median(errs)), "p90": float(np.percentile(errs, 90)),
            "samples": len(errs)}

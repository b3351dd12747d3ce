"""The goodput benchmark's arithmetic, as vLLM's `bench serve` does it (torch-free):

    TTFT   the first token's arrival - the request's send
    ITL    each later token's arrival - the one before (a chunk of several tokens: its
           gap, once)
    TPOT   (e2e - TTFT) / (output tokens - 1), per request (0 for one token)
    E2EL   the last token's arrival - the send

A request is good when it completed and each given SLO holds (TTFT, TPOT, E2EL: each at
most its threshold, as vLLM's `--goodput`). Goodput = good requests
/ the run's duration (the first send to the last answer); attainment = good / sent.
Percentiles are numpy's (linear interpolation). The result carries vLLM's field names
(`request_goodput`, `p90_ttft_ms`, `ttfts`, `itls`, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")
SLO_METRICS = ("ttft", "tpot", "e2el")  # what --goodput may bound, as vLLM's
PERCENTILES = (50, 90, 99)


@dataclass
class Timing:
    """One request as the client saw it (seconds on one monotonic clock)."""

    sent: float
    input_len: int
    token_times: list[float] = field(default_factory=list)  # each chunk's arrival
    output_len: int = 0  # tokens streamed (the usage's count, over HTTP)
    error: str = ""
    # What the servers said of its first token (gRPC's Timings; 0 over HTTP): the wait
    # and the compute on the worker that prefilled it, and the decode worker's KV pull.
    queue_s: float = 0.0
    prefill_s: float = 0.0
    kv_transfer_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.error and bool(self.token_times)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.sent

    @property
    def e2el(self) -> float:
        return self.token_times[-1] - self.sent

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    @property
    def tpot(self) -> float:
        n = self.output_len
        return (self.e2el - self.ttft) / (n - 1) if n > 1 else 0.0


def parse_slos(specs: list[str] | None) -> dict[str, float]:
    """vLLM's `--goodput ttft:MS tpot:MS e2el:MS` -> {metric: seconds}."""
    out: dict[str, float] = {}
    for spec in specs or []:
        name, _, value = spec.partition(":")
        if name not in SLO_METRICS or not value:
            raise ValueError(f"--goodput {spec!r}: want METRIC:MS, METRIC one of "
                             f"{SLO_METRICS}")
        ms = float(value)
        if not ms > 0:
            raise ValueError(f"--goodput {spec!r}: the threshold must be > 0 ms")
        out[name] = ms / 1000
    return out


def good(t: Timing, slos: dict[str, float]) -> bool:
    if not t.ok:
        return False
    return all(getattr(t, name) <= limit for name, limit in slos.items())


def summarize(timings: list[Timing], slos: dict[str, float],
              percentiles: tuple[int, ...] = PERCENTILES) -> dict:
    """vLLM's result fields for one run (one rate), plus `slo_attainment`."""
    done = [t for t in timings if t.ok]
    if timings:
        start = min(t.sent for t in timings)
        end = max([t.token_times[-1] for t in done] + [t.sent for t in timings])
        duration = max(end - start, 1e-9)
    else:
        duration = 1e-9
    good_count = sum(good(t, slos) for t in timings)
    out_tokens = sum(t.output_len for t in done)
    in_tokens = sum(t.input_len for t in done)
    values = {"ttft": [t.ttft for t in done],
              "tpot": [t.tpot for t in done if t.output_len > 1],
              "itl": [x for t in done for x in t.itls],
              "e2el": [t.e2el for t in done]}
    result = {
        "duration": duration, "completed": len(done), "failed": len(timings) - len(done),
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(done) / duration,
        "request_goodput": good_count / duration if slos else None,
        "slo_attainment": good_count / len(timings) if timings and slos else None,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "input_lens": [t.input_len for t in timings],
        "output_lens": [t.output_len for t in timings],
        "ttfts": [t.ttft if t.ok else 0.0 for t in timings],
        "itls": [t.itls if t.ok else [] for t in timings],
        "errors": [t.error for t in timings],
    }
    # The hand-off, as the client sees it: the gap after the first token (in P/D: the
    # decode call, the KV pull and the first decode step), against the others.
    firsts = [t.itls[0] for t in done if len(t.token_times) > 1]
    result["mean_first_itl_ms"] = 1000 * float(np.mean(firsts)) if firsts else 0.0
    for part in ("queue", "prefill", "kv_transfer"):
        result[f"mean_{part}_ms"] = 1000 * float(np.mean(
            [getattr(t, f"{part}_s") for t in done] or [0.0]))
    for name in METRICS:
        xs = np.asarray(values[name] or [0.0]) * 1000
        result[f"mean_{name}_ms"] = float(np.mean(xs))
        result[f"median_{name}_ms"] = float(np.median(xs))
        result[f"std_{name}_ms"] = float(np.std(xs))
        for p in percentiles:
            result[f"p{p}_{name}_ms"] = float(np.percentile(xs, p))
    return result


def replayed(run: dict) -> list[Timing]:
    """A stored result's requests as Timings again (its `ttfts`, `itls`, `output_lens`,
    `errors`; each sent at 0): enough to score them at other SLOs, not to time them."""
    out = []
    for ttft, gaps, n, error in zip(run["ttfts"], run["itls"], run["output_lens"],
                                    run["errors"], strict=True):
        times = list(np.cumsum([ttft, *gaps])) if not error else []
        out.append(Timing(sent=0.0, input_len=0, token_times=times, output_len=n,
                          error=error))
    return out


def rescore(run: dict, slos: dict[str, float]) -> dict:
    """The same requests judged at other SLOs: attainment, and goodput over the stored
    run's duration (the requests' own times do not change with the target)."""
    timings = replayed(run)
    count = sum(good(t, slos) for t in timings)
    return {"slo_attainment": count / len(timings) if timings else 0.0,
            "request_goodput": count / run["duration"]}

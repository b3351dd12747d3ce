"""The goodput benchmark's arithmetic against timings made by hand: goodput counts only
the requests that meet every threshold (a failed one never), over the run's duration;
TPOT skips the first token; percentiles are numpy's; arrivals have the rate asked."""

from __future__ import annotations

import numpy as np
import pytest

from baton.tools.bench.goodput_load import arrivals, jobs
from baton.tools.bench.goodput_stats import Timing, good, parse_slos, summarize


def timings() -> list[Timing]:
    return [
        # TTFT 0.5, tokens every 0.1 s: TPOT 0.1, E2EL 0.8
        Timing(sent=0.0, input_len=10, token_times=[0.5, 0.6, 0.7, 0.8], output_len=4),
        # TTFT 2.0, then 0.5 s for one more: TPOT 0.5, E2EL 2.5
        Timing(sent=1.0, input_len=20, token_times=[3.0, 3.5], output_len=2),
        Timing(sent=1.5, input_len=30, error="UNAVAILABLE: gone"),
        # one token: TTFT = E2EL = 0.2, no TPOT
        Timing(sent=2.0, input_len=40, token_times=[2.2], output_len=1),
    ]


def test_goodput_counts_the_requests_that_meet_every_slo_over_the_duration():
    slos = parse_slos(["ttft:1000", "tpot:200"])
    assert slos == {"ttft": 1.0, "tpot": 0.2}
    assert [good(t, slos) for t in timings()] == [True, False, False, True]
    r = summarize(timings(), slos)
    assert r["duration"] == pytest.approx(3.5)  # first send (0) to the last token (3.5)
    assert r["completed"] == 3 and r["failed"] == 1
    assert r["request_goodput"] == pytest.approx(2 / 3.5)
    assert r["slo_attainment"] == pytest.approx(2 / 4)
    assert r["request_throughput"] == pytest.approx(3 / 3.5)
    assert r["total_output_tokens"] == 7 and r["total_input_tokens"] == 70
    # e2el alone: the second request (2.5 s) misses 2,000 ms, the others meet it.
    e2el = summarize(timings(), parse_slos(["e2el:2000"]))
    assert e2el["request_goodput"] == pytest.approx(2 / 3.5)


def test_percentiles_are_numpys_and_tpot_skips_the_first_token():
    r = summarize(timings(), {})
    ttft_ms = [500.0, 2000.0, 200.0]  # the completed requests'
    for p in (50, 90, 99):
        assert r[f"p{p}_ttft_ms"] == pytest.approx(np.percentile(ttft_ms, p))
    assert r["p90_ttft_ms"] == pytest.approx(1700.0)  # 500 + 0.8 x (2000 - 500)
    assert r["mean_tpot_ms"] == pytest.approx(300.0)  # (100 + 500) / 2: one-token skipped
    assert r["median_itl_ms"] == pytest.approx(100.0)  # gaps 100, 100, 100, 500
    assert r["p99_e2el_ms"] == pytest.approx(np.percentile([800, 2500, 200], 99))
    assert r["request_goodput"] is None and r["slo_attainment"] is None  # no SLO given
    assert r["itls"][0] == pytest.approx([0.1, 0.1, 0.1]) and r["itls"][2] == []


@pytest.mark.parametrize("bad", ["itl:100", "ttft", "tpot:0", "ttft:-5", "x:1"])
def test_an_slo_vllm_does_not_know_is_refused(bad):
    with pytest.raises(ValueError):
        parse_slos([bad])


def test_arrivals_come_at_the_rate_asked_and_bursts_when_asked():
    n, rate = 20_000, 4.0
    for burstiness in (1.0, 0.25):
        t = np.asarray(arrivals(n, rate, burstiness, seed=0))
        gaps = np.diff(t)
        assert t[0] == 0.0 and np.all(gaps >= 0)
        assert gaps.mean() == pytest.approx(1 / rate, rel=0.05)
        # A gamma of shape k: coefficient of variation 1 / sqrt(k) (1: Poisson).
        assert gaps.std() / gaps.mean() == pytest.approx(burstiness ** -0.5, rel=0.05)
    assert arrivals(3, float("inf"), 1.0, 0) == [0.0, 0.0, 0.0]


def test_workloads_are_fixed_by_their_seed_and_keep_their_bounds():
    chat = jobs("chat", 300, 0, 49152)
    assert chat == jobs("chat", 300, 0, 49152) and chat != jobs("chat", 300, 1, 49152)
    prompts = [len(j.prompt) for j in chat]
    outputs = [j.output_len for j in chat]
    assert 100 <= min(prompts) and max(prompts) <= 1500 and 300 < np.median(prompts) < 500
    assert 50 <= min(outputs) and max(outputs) <= 300
    doc = jobs("longdoc", 50, 0, 49152)
    assert all(2048 <= len(j.prompt) <= 8192 and 16 <= j.output_len <= 64 for j in doc)
    assert all(100 <= t < 49152 for j in chat for t in j.prompt)


def test_a_point_whose_arrivals_end_before_requests_settle_is_flagged():
    from baton.tools.bench.goodput import steady, window_s

    # 50 requests a seed at 1/s: arrivals over 50 s; requests living 20 s settle in that.
    r = {"num_prompts": 100, "seeds": [0, 1], "request_rate": 1.0, "mean_e2el_ms": 20_000}
    assert window_s(r) == 50 and steady(r)
    assert not steady({**r, "mean_e2el_ms": 30_000})  # 50 s < 2 x 30 s: a ramp
    assert not steady({**r, "request_rate": 2.0})  # 25 s < 40 s


def test_a_stored_result_scored_again_at_its_own_slos_agrees_and_at_others_moves():
    from baton.tools.bench.goodput_stats import rescore

    slos = parse_slos(["ttft:1000", "tpot:200"])
    run = summarize(timings(), slos)
    again = rescore(run, slos)
    assert again["slo_attainment"] == run["slo_attainment"]
    assert again["request_goodput"] == pytest.approx(run["request_goodput"])
    # TPOT <= 50 ms: the first request's 100 ms gaps now miss too; only the one-token
    # request (no TPOT) meets it.
    assert rescore(run, parse_slos(["tpot:50"]))["slo_attainment"] == 1 / 4
    # TTFT <= 5 s alone: every completed request meets it, the failed one never.
    assert rescore(run, parse_slos(["ttft:5000"]))["slo_attainment"] == 3 / 4

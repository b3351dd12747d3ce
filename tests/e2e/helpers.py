"""What every e2e test shares: requests, their joined output, worker stats, the leak check."""

from __future__ import annotations

import os
import time
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from baton.v1 import generation_pb2 as gen
from baton.v1 import generation_pb2_grpc as gen_grpc
from baton.worker.v1 import worker_pb2 as wk
from baton.worker.v1 import worker_pb2_grpc as wk_grpc
from tests.e2e.topology import channel


def greedy(max_tokens: int, **kw) -> gen.SamplingParams:
    return gen.SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def run(router: str, request: gen.GenerateRequest, timeout: float = 120):
    with channel(router) as ch:
        return list(gen_grpc.GenerationStub(ch).Generate(request, timeout=timeout))


def joined(msgs) -> tuple[list[int], str]:
    """Tokens and text of a stream of responses that carry a `delta` (any service's)."""
    return [t for m in msgs for t in m.delta.token_ids], "".join(m.delta.text for m in msgs)


def stream_diff(msgs, token_ids: list[int], text: str) -> str:
    """Where a stream's tokens and text first part from the reference's, and the messages
    around that point (each one's token offset, ids and text), for a failure message."""
    got_ids, got_text = joined(msgs)
    i = len(os.path.commonprefix([got_ids, token_ids]))  # (any sequences, not only paths)
    j = len(os.path.commonprefix([got_text, text]))
    lo, hi = max(j - 40, 0), j + 40
    lines = [f"{len(got_ids)} ids (want {len(token_ids)}), first different at {i}; "
             f"{len(got_text)} chars (want {len(text)}), first different at {j}: "
             f"got {got_text[lo:hi]!r}, want {text[lo:hi]!r}"]
    ids_at = chars_at = 0
    for n, m in enumerate(msgs):
        ids, delta = list(m.delta.token_ids), m.delta.text
        if chars_at + len(delta) >= lo and chars_at <= hi or ids_at <= i < ids_at + len(ids):
            lines.append(f"  msg {n}: token {ids_at} ids {ids} text {delta!r}")
        ids_at, chars_at = ids_at + len(ids), chars_at + len(delta)
    return "\n".join(lines)


def until_served(router: str, req: gen.GenerateRequest, timeout: float = 30.0):
    """Run `req`, retrying while the router answers UNAVAILABLE (workers not paired yet)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return run(router, req, timeout=60)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def health(address: str) -> int:
    """The gRPC health status a process reports, or -1 if it does not answer."""
    try:
        with channel(address) as ch:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                        timeout=5).status
    except grpc.RpcError:
        return -1  # gone


def stats(address: str) -> wk.GetStatsResponse:
    with channel(address) as ch:
        return wk_grpc.WorkerServiceStub(ch).GetStats(wk.GetStatsRequest(), timeout=5)


def running_worker(workers: dict[str, str], names: tuple[str, ...]) -> str:
    """The name of the worker (of `names` in `workers`, those still up) that runs a
    request now: polled, as a tiny model's request can be between steps at any moment."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for name in names:
            try:
                if stats(workers[name]).num_running:
                    return name
            except grpc.RpcError:  # drained or killed by an earlier test
                continue
        time.sleep(0.005)
    raise AssertionError("no decode worker was running the request")


def scrape(url: str) -> str:
    """The Prometheus text of `url`/metrics."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as reply:
        return reply.read().decode()


def colocated_http(topology, address: str) -> str:
    """Where the colocated service at `address` shows its engine's state: its HTTP port
    (its worker RPCs are not on its public port), for `all_free` and `scrape`."""
    return f"http://{topology.http[address]}"


def all_free(address: str) -> bool:
    """A worker's state from GetStats; a colocated service's (an http:// address) from
    the same counts on its /metrics."""
    if address.startswith("http://"):
        text = scrape(address)
        return all(metric_value(text, f"baton:{name}") == 0 for name in (
            "kv_cache_usage_perc", "num_requests_running", "num_requests_waiting",
            "num_requests_loading", "kv_leases"))
    s = stats(address)
    return (s.num_free_blocks == s.num_blocks and s.num_running == s.num_waiting ==
            s.num_loading == s.num_leases == 0)


def all_free_within(addresses: list[str], seconds: float) -> bool:
    """Whether every worker at `addresses` holds nothing within `seconds` (releases and
    aborts travel over RPCs, so give them a moment)."""
    deadline = time.monotonic() + seconds
    while True:
        if all(all_free(a) for a in addresses):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)


def metric_value(text: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus metric's samples in `text` that carry every label given."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    total = 0.0
    for line in text.splitlines():
        if (line.startswith(name + "{") or line.startswith(name + " ")) and \
                all(w in line for w in want):
            total += float(line.rsplit(" ", 1)[1])
    return total

"""The topologies the goodput benchmark compares on the same cores, each engine pinned to
its share (`--cpus`, threads = its cores), all behind Baton's router and its OpenAI API:

    pd         1 prefill worker (core A) + 1 decode worker (core B)
    decode2    2 decode workers (cores A and B), each computing its own prompts
    colocated  1 colocated worker on both cores (its router in-process)

`pd` takes the router's `--disaggregation` (auto, always, never) as `pd-auto`, ...; plain
`pd` is the router's default. The router itself is not pinned: it shares the cores.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass

from baton.services.rpc.processes import free_port, spawn, stop_all, wait_healthy

from .serve import ENV

TOPOLOGIES = ("pd", "pd-auto", "pd-always", "pd-never", "decode2", "colocated")


@dataclass(frozen=True)
class Served:
    """Where a started topology answers."""

    grpc: str  # the router's gRPC address
    http: str  # its OpenAI API's base URL
    workers: tuple[str, ...]  # the workers' gRPC addresses (stats)
    router_pid: int | None = None  # a router process of its own (not colocated's)
    # Each process by the simulator's name for it (tools/plan/simulator.py: prefill-0,
    # decode-0, decode-1; colocated's one process is decode-0) and "router": its pid.
    pids: tuple[tuple[str, int], ...] = ()


def cores(count: int = 2) -> list[str]:
    """The first `count` cores this process may use, as --cpus values, one per engine."""
    mine = sorted(os.sched_getaffinity(0))
    if len(mine) < count:
        raise ValueError(f"the topologies need {count} cores; this process has {mine}")
    return [str(c) for c in mine[:count]]


def exit_on_sigterm() -> None:
    """SIGTERM ends this process as an exception (exit code 143), so `started`'s
    `finally` stops the topology: its services run in sessions of their own, and
    SIGTERM's default action would leave them running. Main thread only."""

    def leave(signum, frame):
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, leave)


@contextmanager
def started(topology: str, worker_flags: list[str], router_flags: list[str]):
    """The topology up and warmed (every path has served a request); stopped after.
    `router_flags` go to a separate router only (the colocated role's own router reads
    the model from `worker_flags`)."""
    if topology not in TOPOLOGIES:
        raise ValueError(f"topology {topology!r}: one of {TOPOLOGIES}")
    a, b = cores()
    flags = [*worker_flags, "--log-level", "WARNING"]
    procs, workers = [], []
    http = free_port()

    def worker(role: str, cpus: str) -> str:
        address = f"127.0.0.1:{free_port()}"
        procs.append(spawn(role, address, [*flags, "--cpus", cpus], env=ENV))
        workers.append(address)
        return address

    try:
        if topology == "colocated":
            address = f"127.0.0.1:{free_port()}"
            procs.append(spawn("colocated", address, [*flags, "--cpus", f"{a},{b}",
                                                      "--http-port", str(http)], env=ENV))
            wait_healthy(address, procs[0], 600)
            served = Served(address, f"http://127.0.0.1:{http}", (address,),
                            pids=(("decode-0", procs[0].pid),))
        else:
            roles = (("prefill", a), ("decode", b)) if topology.startswith("pd") else \
                (("decode", a), ("decode", b))
            made = [(role, worker(role, cpus)) for role, cpus in roles]
            for (_, address), p in zip(made, procs, strict=True):
                wait_healthy(address, p, 600)
            mode = topology.partition("-")[2]
            route = [f for role, address in made for f in (f"--{role}", address)]
            if mode:
                route += ["--disaggregation", mode]
            address = f"127.0.0.1:{free_port()}"
            procs.append(spawn("router", address, [*router_flags, *route, "--log-level",
                                                   "WARNING", "--http-port", str(http)],
                               env=ENV))
            wait_healthy(address, procs[-1], 120)
            pids = [(f"{role}-{sum(r == role for r, _ in made[:i])}", procs[i].pid)
                    for i, (role, _) in enumerate(made)]
            served = Served(address, f"http://127.0.0.1:{http}", tuple(workers),
                            procs[-1].pid, (*pids, ("router", procs[-1].pid)))
        asyncio.run(_until_served(served))
        yield served
    finally:
        stop_all(procs)


async def _until_served(served: Served) -> None:
    """Until a request has gone through each worker (the router pairs on its polls)."""
    from .goodput_load import Job, run

    deadline = time.monotonic() + 120
    while True:
        got = await run([Job([100 + i for i in range(40)], 4)] * 4, [0.0] * 4, "grpc",
                        served.grpc)
        if all(t.ok for t in got):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the topology never served: {got[0].error}")
        await asyncio.sleep(0.5)


def cpu_seconds(pid: int) -> float:
    """The CPU time process `pid` has used (user + system), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_cpu_seconds() -> float:
    """The CPU time this process has used, every thread's (user + system)."""
    t = os.times()
    return t.user + t.system


def local_prefills(http: str) -> dict[str, float]:
    """The router's prompts computed on a decode worker so far, by reason
    (baton:local_prefills_total, from its /metrics)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(f"{http}/metrics", timeout=30).text
    except httpx.HTTPError:  # a server without them: nothing to tell
        return {}
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "baton:local_prefills_total":
                reason = sample.labels["reason"]
                counts[reason] = counts.get(reason, 0.0) + sample.value
    return counts

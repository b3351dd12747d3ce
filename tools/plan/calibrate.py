"""What an engine's steps cost inside a service, against the same steps offline.

The offline profile times `engine.step()` alone on its cores. A served engine shares them
with its gRPC server, the router's streams and, colocated, its in-process router (one
interpreter, one GIL): measured on a 2-core Xeon, a colocated engine on two threads
decoded a token in 52 ms served where the offline profile said 31 ms (an OpenMP team of
two waits for whichever thread the server's work took a core from), and one on one
thread in 49 ms against 46. So `baton profile` also serves each engine, as the goodput
benchmark's topologies serve it, sends prompts one at a time (of the lengths the
workload sends: 256 and 1,024 tokens, or longdoc's 2,048 and 6,144), and keeps, per
engine:

    prefill         the first token's time (past the router's hop) over the prompt's
                    steps offline: a factor (the team's waits grow with the compute)
    decode_extra_s  the median gap between later tokens less one decode step at that
                    context: seconds added to a step (the server's work is per step:
                    a ratio taken at batch 1 put a colocated engine's P90 ITL at 1/s of
                    chat 25% over the measured one; added, 6% over)

The simulator applies them to each step by the share of its tokens that are prompt
tokens (`cost`).
"""

from __future__ import annotations

import asyncio
import random
import statistics

from .step_model import StepModel

# The goodput benchmark's topology that serves one engine of `threads` threads (on the
# first cores): two single-thread decode workers, or one colocated worker on two cores.
SERVED = {1: "decode2", 2: "colocated"}
PROMPTS = (256, 1024)
LONG_PROMPTS = (2048, 6144)  # --longdoc: the lengths its workload sends (2-8K)
OUTPUT = 24
CHUNK = 2048  # the served workers' step budget (the engine's default, as the benchmark's)


def prompt_seconds(model: StepModel, n: int, chunk: int = CHUNK) -> float:
    """The offline seconds of an n-token prompt computed alone, in steps of at most
    `chunk` tokens, each over the tokens before it."""
    return sum(model.predict([(min(chunk, n - done), done)]) for done in range(0, n, chunk))


def in_service(args, threads: int, model: StepModel, hop_s: float) -> dict | None:
    """The factors of the engine with `threads` threads, or None where no benchmark
    topology serves that engine alone."""
    from baton.tools.bench.goodput_load import Job, run
    from baton.tools.bench.goodput_topology import started

    topology = SERVED.get(threads)
    if topology is None:
        return None
    flags = ["--dtype", args.dtype, "--kv-cache-gib", "1", "--no-enable-prefix-caching",
             *args.worker_model]
    router = args.router_model
    rng = random.Random(2)
    prefill, decode, extra = [], [], []
    lengths = LONG_PROMPTS if args.longdoc else PROMPTS
    lengths = lengths[:1] if args.quick else lengths
    with started(topology, flags, router) as served:
        for _ in range(args.repeats + 1):
            for n in lengths:
                job = Job([rng.randrange(100, 49000) for _ in range(n)], OUTPUT)
                (t,) = asyncio.run(run([job], [0.0], "grpc", served.grpc))
                if not t.ok:
                    raise RuntimeError(f"a calibration probe failed: {t.error}")
                prefill.append((t.ttft - hop_s) / prompt_seconds(model, n))
                gaps = sorted(t.itls[1:])  # past the first (a local prefill's own step)
                step = model.predict([(1, n + OUTPUT // 2)])
                decode.append(statistics.median(gaps) / step)
                extra.append(statistics.median(gaps) - step)
    return {"prefill": statistics.median(prefill), "decode": statistics.median(decode),
            "decode_extra_s": statistics.median(extra), "topology": topology,
            "probes": len(prefill)}


def cost(service: dict | None, batch: list[tuple[int, int]], offline_s: float) -> float:
    """A served step's seconds from its offline ones: a step of prompt tokens times the
    prefill factor, a step of decodes plus decode_extra_s, a mixed one by the share of
    its tokens that are prompt tokens."""
    if not service:
        return offline_s
    total = sum(n for n, _ in batch)
    share = sum(n for n, _ in batch if n > 1) / total if total else 0.0
    return (offline_s * (1.0 + (service["prefill"] - 1.0) * share)
            + service.get("decode_extra_s", 0.0) * (1.0 - share))

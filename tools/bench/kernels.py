"""Baton's CPU kernels (kernels/cpu_ops.py) against the torch ops they replace, on every
ISA this CPU runs, at the default model's shapes: where each is faster decides
cpu_ops.FASTER.

    python -m baton.tools.bench.kernels [--threads N] [--repeat 20]

Prints, per kernel and ISA, the best time of `repeat` calls for the kernel and for torch's
ops, and their ratio (> 1: the kernel is faster), with the CPU and its flags.
"""

from __future__ import annotations

import argparse
import random
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from baton.kernels import cpu_ops, kv_layout, torch_attn
from baton.kernels.metadata import AttentionMetadata, count_shared_blocks
from baton.services.engine.models.layers import RMSNorm, apply_rope

# The default model's shapes (SmolLM2-135M): hidden, MLP width, heads, KV heads, head dim.
HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 576, 1536, 9, 3, 64, 16
DTYPE = torch.bfloat16


def best(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def decode_batch(rows: int, length: int, shared_blocks: int):
    """`rows` decodes of about `length` tokens over a cache of shuffled blocks, the first
    `shared_blocks` of every table the same (a cached prefix)."""
    rng = random.Random(0)
    per_row = -(-length // BLOCK)
    num_blocks = rows * per_row + 1
    cache = torch.randn(kv_layout.shape(num_blocks, KV_HEADS, BLOCK, HEAD_DIM),
                        dtype=DTYPE)
    ids = list(range(1, num_blocks))
    rng.shuffle(ids)
    tables = torch.tensor([ids[i * per_row:(i + 1) * per_row] for i in range(rows)],
                          dtype=torch.int32)
    tables[:, :shared_blocks] = tables[0, :shared_blocks]
    lens = [length - rng.randint(0, BLOCK - 1) for _ in range(rows)]
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(rows, dtype=torch.long),
        query_start_loc=torch.arange(rows + 1, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=tables,
        num_decodes=rows, query_start_loc_cpu=list(range(rows + 1)), seq_lens_cpu=lens,
        max_seq_len=max(lens), max_query_len=1, decode_max_seq_len=max(lens),
        num_shared_blocks=count_shared_blocks(tables, lens, BLOCK))
    q = torch.randn(rows, HEADS, HEAD_DIM, dtype=DTYPE)
    return q, cache, meta


def prefill_batch(chunks: list[tuple[int, int]]):
    """Prefill chunks of (cached tokens, new tokens), K/V written to the cache already."""
    per = [-(-(c + n) // BLOCK) for c, n in chunks]
    cache = torch.randn(kv_layout.shape(sum(per) + 1, KV_HEADS, BLOCK, HEAD_DIM), dtype=DTYPE)
    ids = list(range(1, sum(per) + 1))
    random.Random(1).shuffle(ids)
    tables = torch.zeros(len(chunks), max(per), dtype=torch.int32)
    at = 0
    for i, n in enumerate(per):
        tables[i, :n] = torch.tensor(ids[at:at + n])
        at += n
    starts = [0]
    for _, n in chunks:
        starts.append(starts[-1] + n)
    lens = [c + n for c, n in chunks]
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(starts[-1], dtype=torch.long),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=tables, num_decodes=0,
        query_start_loc_cpu=starts, seq_lens_cpu=lens, max_seq_len=max(lens),
        max_query_len=max(n for _, n in chunks), decode_max_seq_len=0)
    q = torch.randn(starts[-1], HEADS, HEAD_DIM, dtype=DTYPE)
    k = torch.randn(starts[-1], KV_HEADS, HEAD_DIM, dtype=DTYPE)
    return q, k, torch.randn_like(k), cache, meta


def without(kernel: str, fn):
    """fn() with `kernel` not serving: torch's ops instead."""
    saved = cpu_ops.FASTER[kernel]
    cpu_ops.FASTER[kernel] = frozenset()
    try:
        return fn()
    finally:
        cpu_ops.FASTER[kernel] = saved


def cases(repeat: int):
    """(name, kernel's call given its ops, torch's call)."""
    x = torch.randn(2048, HIDDEN, dtype=DTYPE)
    res = torch.randn(2048, HIDDEN, dtype=DTYPE)
    norm = RMSNorm(HIDDEN, 1e-5, DTYPE, torch.device("cpu"))
    norm.weight.data.normal_()
    gate_up = torch.randn(2048, 2 * INTER, dtype=DTYPE)
    yield ("rms_norm + add, 2048 x 576",
           lambda ops: cpu_ops.rms_norm(x, norm.weight, 1e-5, 0.0, res, ops),
           lambda: norm._torch(x + res))
    for tokens in (64, 2048):  # a decode step's, a prefill step's
        qk = torch.randn(tokens, HEADS + KV_HEADS, HEAD_DIM, dtype=DTYPE)
        v = torch.randn(tokens, KV_HEADS, HEAD_DIM, dtype=DTYPE)
        cs = torch.randn(tokens, 1, HEAD_DIM // 2, dtype=DTYPE)
        blocks = tokens // BLOCK * 4
        cache = torch.zeros(kv_layout.shape(blocks, KV_HEADS, BLOCK, HEAD_DIM), dtype=DTYPE)
        slots = torch.randperm(blocks * BLOCK)[:tokens]

        def fused(ops, qk=qk, v=v, cs=cs, cache=cache, slots=slots):
            ops.rope_and_cache(qk, v, cs[:, 0], cs[:, 0], *kv_layout.head_views(cache), slots,
                               KV_HEADS)

        def unfused(qk=qk, v=v, cs=cs, cache=cache, slots=slots):
            k = apply_rope(qk, cs, cs)[:, HEADS:]
            torch_attn.reshape_and_cache(k, v, cache, slots)

        yield f"rope_and_cache, {tokens} tokens", fused, unfused
    yield ("silu_and_mul, 2048 x 1536",
           lambda ops: cpu_ops.silu_and_mul(gate_up, ops),
           lambda: F.silu(gate_up[:, :INTER]) * gate_up[:, INTER:])
    for rows, length, shared in ((64, 320, 0), (64, 1100, 64), (1, 1500, 0)):
        q, cache, meta = decode_batch(rows, length, shared)
        out = torch.empty_like(q)
        views = kv_layout.head_views(cache)

        def kernel(ops, q=q, views=views, meta=meta, out=out):
            ops.decode(q, *views, meta.block_tables, meta.seq_lens, out, HEAD_DIM**-0.5, 0, 0.0)

        def torch_path(q=q, cache=cache, meta=meta, out=out):
            without("decode", lambda: torch_attn._decode(q, cache, meta, HEAD_DIM**-0.5, out,
                                                         None, None, None))

        label = f"decode, {rows} rows x {length} tokens" + (
            f", {shared} shared blocks" if shared else "")
        yield label, kernel, torch_path
    # W3's prefill steps: 2,048 tokens of new prompts and of prompts cut at the last step.
    for chunks in ([(0, 1024), (0, 1024)], [(0, 700), (512, 400), (0, 948)], [(0, 256)] * 8):
        q, k, v, cache, meta = prefill_batch(chunks)
        out = torch.empty_like(q)
        views = kv_layout.head_views(cache)

        def pkernel(ops, q=q, views=views, meta=meta, out=out):
            ops.prefill(q, *views, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0,
                        out, HEAD_DIM**-0.5, 0, 0.0)

        def ptorch(q=q, k=k, v=v, cache=cache, meta=meta, out=out):
            without("prefill", lambda: torch_attn._prefill(q, k, v, cache, meta,
                                                           HEAD_DIM**-0.5, out, None, None,
                                                           None))

        flops = sum(4 * n * (c + (n + 1) / 2) * HEAD_DIM * HEADS for c, n in chunks)
        label = "prefill, (cached, new) " + " ".join(f"{c}+{n}" for c, n in chunks)
        yield label, pkernel, ptorch, flops


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from .machine import machine_line

    print(machine_line(SimpleNamespace(hidden_size=HIDDEN, intermediate_size=INTER), DTYPE))
    print(f"threads {args.threads}; ISAs {' '.join(cpu_ops.supported())}; serving "
          f"{cpu_ops.isa}")
    print("| kernel | ISA | kernel (ms) | torch (ms) | torch / kernel | serves | GFLOP/s |")
    print("|---|---|---|---|---|---|---|")
    for name, kernel, torch_fn, *flops in cases(args.repeat):
        ours = best(torch_fn, args.repeat)
        for isa in cpu_ops.supported():
            ops = cpu_ops.ops(isa)
            if ops is None:
                print(f"| {name} | {isa} | unavailable: {cpu_ops.failure(isa)} | | | |")
                continue
            t = best(lambda ops=ops, kernel=kernel: kernel(ops), args.repeat)
            key = name.split(",")[0].split(" ")[0]
            serves = "yes" if isa in cpu_ops.FASTER.get(key, ()) else "no"
            rate = f"{flops[0] / t / 1e6:.0f} (torch {flops[0] / ours / 1e6:.0f})" if flops else ""
            print(f"| {name} | {isa} | {t:.3f} | {ours:.3f} | {ours / t:.2f} | {serves} | "
                  f"{rate} |")


if __name__ == "__main__":
    main()

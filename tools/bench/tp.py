"""Tensor parallelism on this machine: throughput and the cost per step of TP=N against
TP=1, and the bytes each decode rank pulls when prefill and decode differ in TP size.

    python -m baton.tools.bench.tp [--workloads w1,w3] [--tp 1,3] [--rounds 2]
    python -m baton.tools.bench.tp --heads 12:4 --tp 1,2   # the same sizes, 12 heads
    python -m baton.tools.bench.tp --handoff 3:1,1:3 [--requests 16]

The default model (SmolLM2-135M: 9 heads, 3 KV heads) splits over 3 or 9 ranks, not 2;
`--model` takes another, and `--heads Q:KV` builds one of the default model's sizes (576
wide, 30 layers, MLP 1536, vocabulary 49152) with Q heads and KV heads of 576/Q, its
weights random (load_format dummy: the timing of the shapes, not of the outputs).
Every TP size keeps one engine for the whole run, and the sizes
run in alternating rounds (each keeps its best round). Per step it reports rank 0's time
in the group's calls: `send` (the step's inputs to the other ranks) and the collectives
inside the model (all-reduce and the logits' gather, waits for slower ranks included).
On a 2-core machine N ranks share 2 cores: expect no speed-up, only the overhead.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from collections import defaultdict

import torch

from baton.kv_transfer.base import KVHandle
from baton.kv_transfer.blocks import read_heads
from baton.kv_transfer.grpc_stream import GrpcStreamReceiver
from baton.kv_transfer.head_map import rank_block_bytes
from baton.services.common.sampling_params import SamplingParams
from baton.services.engine.llm import LLM
from baton.services.engine.parallel import TPGroup

from .machine import machine_line, trim
from .workloads import make_workload

SPENT: dict[str, float] = defaultdict(float)  # rank 0's seconds in the group's calls


def _timed(name: str):
    real = getattr(TPGroup, name)

    def wrapper(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return real(self, *args, **kwargs)
        finally:
            SPENT["send" if name == "send" else "collectives"] += time.perf_counter() - t0

    setattr(TPGroup, name, wrapper)


for _name in ("send", "all_reduce", "gather_vocab"):
    _timed(_name)


def run(llm: LLM, wl) -> tuple[float, int, float, dict[str, float]]:
    """(output tok/s, steps, seconds, rank 0's seconds in the group's calls)."""
    engine = llm.engine
    params = SamplingParams(max_tokens=wl.output_len, temperature=0, ignore_eos=True)
    llm.generate([wl.prompts[0][:16]], SamplingParams(max_tokens=4))  # warm-up
    llm.reset_prefix_cache()
    SPENT.clear()
    for p in wl.prompts:
        engine.add_request(p, params)
    steps, produced = 0, 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        produced += sum(len(o.new_token_ids) for o in engine.step())
        steps += 1
    elapsed = time.perf_counter() - start
    return produced / elapsed, steps, elapsed, dict(SPENT)


def same_sizes(heads: str, folder: str) -> dict:
    """LLM kwargs for the default model's sizes with other head counts, random weights."""
    from transformers import LlamaConfig

    from baton.services.common.default_model import default_model_path

    q, kv = (int(x) for x in heads.split(":"))
    shape: dict = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=q, num_key_value_heads=kv, vocab_size=49152,
                       max_position_embeddings=8192, rope_theta=100000.0,
                       tie_word_embeddings=True, torch_dtype="bfloat16")
    LlamaConfig(**shape).save_pretrained(folder)
    return {"model": folder, "tokenizer": str(default_model_path()), "load_format": "dummy"}


def throughput(args) -> None:
    sizes = [int(x) for x in args.tp.split(",")]
    model = {"model": args.model}
    if args.heads:
        model = same_sizes(args.heads, tempfile.mkdtemp(prefix="baton-tp-bench-"))
    llms = {n: LLM(**model, dtype=args.dtype, kv_cache_gib=args.kv_cache_gib,
                   tensor_parallel_size=n) for n in sizes}
    first = llms[sizes[0]]
    print(machine_line(first.engine.model_config, getattr(torch, args.dtype)), flush=True)
    for name in args.workloads.split(","):
        wl = trim(make_workload(name, first.engine.model_config.vocab_size), args.requests)
        best: dict[int, tuple] = {}
        for _ in range(args.rounds):
            for n in sizes:
                r = run(llms[n], wl)
                if n not in best or r[0] > best[n][0]:
                    best[n] = r
        base = best[sizes[0]][0]
        for n in sizes:
            tps, steps, secs, spent = best[n]
            print(f"{name} TP={n}: {tps:.1f} output tok/s ({tps / base:.2f}x TP={sizes[0]}), "
                  f"{steps} steps, {1000 * secs / steps:.1f} ms/step; rank 0 in send "
                  f"{1000 * spent.get('send', 0) / steps:.2f} ms/step, in collectives "
                  f"{1000 * spent.get('collectives', 0) / steps:.2f} ms/step", flush=True)
    for llm in llms.values():
        llm.engine.close()


def handoff(args) -> None:
    """Prefill TP=a -> decode TP=b in one process over the gRPC stream's receiver: the
    bytes each decode rank pulled, against one whole block's."""
    for pair in args.handoff.split(","):
        a, b = (int(x) for x in pair.split(":"))
        p = LLM(model=args.model, dtype=args.dtype, kv_cache_gib=args.kv_cache_gib,
                tensor_parallel_size=a).engine

        def fetch(handle, ids, heads, p=p):
            yield read_heads(p.rank_kv_caches, p.kv_layout.num_kv_heads, ids, heads)

        made = {}

        def receiver(layout, caches, fetch=fetch, made=made):
            made["r"] = GrpcStreamReceiver(layout, caches, fetch)
            return made["r"]

        d = LLM(model=args.model, dtype=args.dtype, kv_cache_gib=args.kv_cache_gib,
                tensor_parallel_size=b, kv_receiver=receiver).engine
        made["r"].add_peer("p", p.kv_layout, b"")
        wl = trim(make_workload("w1", p.model_config.vocab_size), args.requests)
        params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        for i, prompt in enumerate(wl.prompts):
            p.add_request(prompt, params, request_id=f"r{i}", kv_hold=True)
        firsts = {}
        while p.has_unfinished_requests():
            firsts.update({o.request_id: o for o in p.step() if o.kv_block_ids})
        blocks = 0
        for rid, o in firsts.items():
            h = KVHandle("p", rid, o.kv_lease_id, tuple(o.kv_block_ids),
                         len(o.prompt_token_ids), verified=True)
            d.add_remote_request(o.prompt_token_ids, o.new_token_ids[0], h, params,
                                 request_id=rid)
            blocks += len(o.kv_block_ids)
        while d.has_unfinished_requests():
            d.step()
        for rid, o in firsts.items():
            p.release_lease(rid, o.kv_lease_id)
        pulled = made["r"].pulled_bytes
        whole = p.kv_layout.block_bytes
        assert pulled == [blocks * rank_block_bytes(d.kv_layout, r) for r in range(b)]
        print(f"prefill TP={a} -> decode TP={b}: {blocks} blocks ({blocks * whole / 2**20:.2f} "
              f"MiB whole); per decode rank " + ", ".join(
                  f"{x / 2**20:.2f} MiB ({x / (blocks * whole):.2f} of each block)"
                  for x in pulled), flush=True)
        made["r"].close()
        p.close()
        d.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-cache-gib", type=float, default=2.0, help="per rank")
    ap.add_argument("--workloads", default="w1,w3")
    ap.add_argument("--tp", default="1,3", help="TP sizes; the first is the baseline")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--heads", default=None,
                    help="Q:KV: the default model's sizes with these head counts, random")
    ap.add_argument("--handoff", default=None,
                    help="prefill:decode TP pairs, e.g. 3:1,1:3 (bytes per decode rank)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.handoff:
        handoff(args)
    else:
        throughput(args)


if __name__ == "__main__":
    main()

"""Baton against vLLM's CPU backend on W1, W2 (prefix caching off and on) and W3, back to
back, alternating, one fresh process per run; prints one table of ratios.

    python -m baton.tools.bench.vs_vllm [--rounds 2] [--vllm-python .cache/vllm-venv/bin/python]

Both run bf16 at their default settings (4 GiB of KV each), greedy with ignore_eos, on the
same dequantized weights (vLLM reads the HF directory that scripts/export_hf_dir.py
writes). Each round runs every workload through both systems, the order swapped every
round; each system keeps its best run per workload (the machines are noisy on the scale
of tens of seconds). Throughput is output tokens per second, model loading excluded.
Where vLLM is not installed (`make vllm` installs it), its runs are skipped, saying so,
and Baton's figures are printed alone.

Both compute on every core this process may use. vLLM's CPU backend by default keeps a
core for its own scheduler and binds its OpenMP threads to the rest: on 2 cores its
model ran on one while Baton's ran on two. `vllm_env` binds it to all of them
(VLLM_CPU_OMP_THREADS_BIND, VLLM_CPU_NUM_OF_RESERVED_CPU=0); the run prints the setting.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from baton.services.common.default_model import cache_dir

from .workloads import make_workload

ROOT = Path(__file__).resolve().parents[2]
# vLLM's venv has no Baton installed: the checkout's root and protos/ (where `baton` is).
SOURCE_PATH = os.pathsep.join([str(ROOT), str(ROOT / "protos")])
# (label, workload, prefix caching)
RUNS = [("W1", "w1", True), ("W2 caching off", "w2", False), ("W2 caching on", "w2", True),
        ("W3", "w3", True)]


def baton_child(workload: str, caching: bool) -> None:
    """One run in this process (the child side): one JSON line."""
    from baton.services.engine.llm import LLM

    from .offline import run_baton

    llm = LLM(dtype="bfloat16", kv_cache_gib=4.0, enable_prefix_caching=caching)
    wl = make_workload(workload, llm.engine.model_config.vocab_size)
    print(json.dumps({"system": "baton", "workload": wl.name, "prefix_caching": caching,
                      "tok_s": run_baton(llm, wl)}), flush=True)


def vllm_env(cores: list[int]) -> dict[str, str]:
    """vLLM's settings for a run: 4 GiB of KV, its OpenMP threads bound to `cores`, none
    kept back for its scheduler."""
    return {"VLLM_CPU_KVCACHE_SPACE": "4",
            "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores)),
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def run(cmd: list[str], env: dict | None = None) -> float:
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=SOURCE_PATH, **(env or {})))
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode or not lines:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stdout[-2000:]}{out.stderr[-4000:]}")
    return json.loads(lines[-1])["tok_s"]


def hf_dir() -> Path:
    """The default model as an HF directory for vLLM, written once into the cache."""
    out = cache_dir() / "models" / "SmolLM2-135M-Instruct-hf"
    if not (out / "config.json").exists():
        subprocess.run([sys.executable, "scripts/export_hf_dir.py", str(out)], cwd=ROOT,
                       check=True, env=dict(os.environ, PYTHONPATH=SOURCE_PATH))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--vllm-python", default=str(cache_dir() / "vllm-venv" / "bin" / "python"))
    ap.add_argument("--only", nargs="*", help="labels to run (default: all)")
    ap.add_argument("--child", nargs=2, metavar=("WORKLOAD", "CACHING"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        baton_child(args.child[0], args.child[1] == "on")
        return
    runs = [r for r in RUNS if not args.only or r[0] in args.only]
    vllm = Path(args.vllm_python)
    if not vllm.exists():
        print(f"vLLM is not installed at {vllm} (`make vllm`): its runs are skipped",
              flush=True)
        vllm = None
    model = hf_dir() if vllm else None
    env = vllm_env(sorted(os.sched_getaffinity(0)))
    if vllm:
        print("vLLM: " + " ".join(f"{k}={v}" for k, v in env.items()), flush=True)
    best: dict[tuple[str, str], float] = {}
    for r in range(args.rounds):
        for label, workload, caching in runs:
            systems = ["baton", "vllm"] if r % 2 == 0 else ["vllm", "baton"]
            for system in systems:
                if system == "vllm" and vllm is None:
                    continue
                if system == "baton":
                    cmd = [sys.executable, "-m", "baton.tools.bench.vs_vllm", "--child", workload,
                           "on" if caching else "off"]
                    tok_s = run(cmd)
                else:
                    cmd = [str(vllm), "scripts/vllm_bench.py", str(model), workload]
                    tok_s = run(cmd + ([] if caching else ["--no-prefix-caching"]), env)
                print(f"round {r + 1}: {label:15s} {system:5s} {tok_s:8.1f} output tok/s",
                      flush=True)
                best[label, system] = max(best.get((label, system), 0.0), tok_s)
    print("\n| workload | Baton tok/s | vLLM-CPU tok/s | Baton / vLLM |\n|---|---|---|---|")
    for label, _, _ in runs:
        b, v = best[label, "baton"], best.get((label, "vllm"))
        print(f"| {label} | {b:.1f} | {v:.1f} | {b / v:.2f}x |" if v else
              f"| {label} | {b:.1f} | (skipped) | |")
    if ("W2 caching on", "baton") in best and ("W2 caching off", "baton") in best:
        ratio = best["W2 caching on", "baton"] / best["W2 caching off", "baton"]
        print(f"\nBaton W2 caching on / off: {ratio:.2f}x", flush=True)


if __name__ == "__main__":
    main()

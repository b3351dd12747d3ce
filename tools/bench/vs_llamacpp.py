"""Baton against llama.cpp (llama-cpp-python) on the same GGUF: batch-1 decode, then W1
through each one's OpenAI-compatible server.

    python -m baton.tools.bench.vs_llamacpp [--rounds 5] [--quantization Q] [--quick]
        [--only batch1|w1] [--model F.gguf] [--llama-python .cache/llama-venv/bin/python]

Batch 1: one fixed prompt, greedy, `--tokens` tokens after it (EOS ignored), `--threads`
threads each: llama.cpp's `Llama` (scripts/llamacpp_bench.py, in llama.cpp's own venv:
`make llamacpp`) and Baton's offline engine (engine steps, timed as tools/bench/latency.py
times them), each a process of its own kept for every round, the order alternating per
round; the decode's tok/s, best and median over the rounds.

W1 (docs/benchmarks.md): `python -m llama_cpp.server` and `baton serve` (colocated), one at
a time on free ports, started and stopped here; W1's 64 prompts (its random ids as text,
which both tokenize alike: the same vocabulary) sent `--concurrency` at a time as
non-streamed completions, greedy, `output_len` tokens each (EOS ignored: Baton's
ignore_eos, llama.cpp's min_tokens); total output tok/s of each and the ratio.

Baton runs `--dtype` (bf16) over the GGUF; `--quantization` reaches it (LLM(...) and
`baton serve`) only when given. The CPU, its flags and the thread counts print first.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from baton.services.common.default_model import cache_dir, default_model_path
from baton.services.rpc.processes import free_port

ROOT = Path(__file__).resolve().parents[2]
PROMPT = ("The history of the printing press begins in the fifteenth century, when a "
          "goldsmith in Mainz")
SERVER_START_S = 300


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    ap.add_argument("--model", default=str(default_model_path()), help="a GGUF file")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128, help="batch 1: tokens after the prompt")
    ap.add_argument("--rounds", type=int, default=5, help="batch-1 rounds")
    ap.add_argument("--serve-rounds", type=int, default=1, help="W1 rounds")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", help="passed to Baton only when given")
    ap.add_argument("--kv-cache-gib", type=float, default=2.0)
    ap.add_argument("--only", choices=["batch1", "w1"])
    ap.add_argument("--llama-python", default=str(cache_dir() / "llama-venv" / "bin" / "python"))
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: 2 rounds of 32 tokens; W1's first 8 prompts, 32 tokens")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--prompt-ids", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.w1_requests = args.w1_output = None
    if args.quick:
        args.rounds, args.tokens, args.serve_rounds = 2, 32, 1
        args.w1_requests, args.w1_output = 8, 32
        args.concurrency = min(args.concurrency, 8)
    for name in ("threads", "tokens", "rounds", "serve_rounds", "concurrency"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.tokens < 2:
        ap.error("--tokens must be >= 2 (the decode is timed from the first token on)")
    return args


def baton_llm_kwargs(args: argparse.Namespace) -> dict:
    kw = {"model": args.model, "dtype": args.dtype, "kv_cache_gib": 1.0,
          "enable_prefix_caching": False}
    if args.quantization is not None:
        kw["quantization"] = args.quantization
    return kw


def baton_serve_flags(args: argparse.Namespace, http_port: int) -> list[str]:
    flags = ["--model", args.model, "--dtype", args.dtype, "--threads", str(args.threads),
             "--kv-cache-gib", str(args.kv_cache_gib), "--http-port", str(http_port),
             "--log-level", "WARNING"]
    if args.quantization is not None:
        flags += ["--quantization", args.quantization]
    return flags


def llama_server_cmd(args: argparse.Namespace, port: int) -> list[str]:
    # interrupt_requests off: on, a queued request cuts the running one's stream short.
    return [args.llama_python, "-P", "-m", "llama_cpp.server", "--model", args.model,
            "--n_threads", str(args.threads), "--n_threads_batch", str(args.threads),
            "--n_ctx", "2048", "--host", "127.0.0.1", "--port", str(port),
            "--interrupt_requests", "False"]


def completion_body(system: str, model: str, prompt: str, max_tokens: int) -> dict:
    """A greedy completion of exactly max_tokens tokens, in each server's own words."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    if system == "baton":
        body["ignore_eos"] = True
    else:  # llama.cpp bans EOS until min_tokens; its default repeat penalty is 1.1
        body.update(min_tokens=max_tokens, repeat_penalty=1.0)
    return body


def read_result(line: str) -> dict | None:
    """A child's JSON line, or None for anything else it printed."""
    line = line.strip()
    if not line.startswith("{"):
        return None
    try:
        value = json.loads(line)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def completion_tokens(reply: dict) -> int:
    """Output tokens of a non-streamed /v1/completions reply (its usage)."""
    return int(reply["usage"]["completion_tokens"])


def best_and_median(values: list[float]) -> tuple[float, float]:
    return max(values), statistics.median(values)


def leading_agreement(a: list[int], b: list[int]) -> int:
    """How many tokens two greedy runs share before they first differ."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# ---- batch 1 --------------------------------------------------------------------------


def baton_child(args: argparse.Namespace) -> None:
    """Baton's side of batch 1, in its own process: the same protocol as
    scripts/llamacpp_bench.py (ready line, then one run per stdin line)."""
    import torch

    from baton.services.common.sampling_params import SamplingParams
    from baton.services.engine.llm import LLM

    from .machine import machine_line

    torch.set_num_threads(args.threads)
    llm = LLM(**baton_llm_kwargs(args))
    engine = llm.engine
    prompt = [int(t) for t in args.prompt_ids.split(",")]
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    llm.generate([prompt], SamplingParams(max_tokens=4))  # warm-up
    print(json.dumps({"ready": True, "torch_threads": torch.get_num_threads(),
                      "machine": machine_line(engine.model_config, engine.runner.dtype)}),
          flush=True)
    for _ in sys.stdin:
        rid = engine.add_request(prompt, params)
        first, tokens = None, []
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == rid and out.new_token_ids:
                    first = first or time.perf_counter()
                    tokens += out.new_token_ids
        tok_s = (len(tokens) - 1) / (time.perf_counter() - first) if first else 0.0
        print(json.dumps({"tok_s": tok_s, "tokens": tokens}), flush=True)


class Child:
    """A process that answers one JSON line per line it is sent."""

    def __init__(self, name: str, cmd: list[str]):
        self.name = name
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.ready = self.reply()

    def reply(self) -> dict:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            got = read_result(line)
            if got is not None:
                return got
        self.log.seek(0)
        raise RuntimeError(f"{self.name} exited with {self.proc.wait()}:\n"
                           f"{self.log.read()[-4000:]}")

    def run(self) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        return self.reply()

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def batch1(args: argparse.Namespace, prompt: list[int]) -> None:
    ids = ",".join(map(str, prompt))
    extra = ["--quantization", args.quantization] if args.quantization else []
    children = {}
    try:
        children["baton"] = Child("baton", [
            sys.executable, "-m", "baton.tools.bench.vs_llamacpp", "--child", "--model",
            args.model, "--dtype", args.dtype, "--threads", str(args.threads), "--tokens",
            str(args.tokens), "--prompt-ids", ids, *extra])
        children["llama.cpp"] = Child("llama.cpp", [
            args.llama_python, "-P", "scripts/llamacpp_bench.py", args.model, "--threads",
            str(args.threads), "--tokens", str(args.tokens), "--prompt-ids", ids])
        print(children["baton"].ready["machine"])
        print(f"threads: Baton torch {children['baton'].ready['torch_threads']}, llama.cpp "
              f"{args.threads}; llama-cpp-python {children['llama.cpp'].ready['version']}: "
              f"{children['llama.cpp'].ready['system_info']}", flush=True)
        got: dict[str, list[float]] = {name: [] for name in children}
        last: dict[str, list[int]] = {}
        for r in range(args.rounds):
            for name in (("baton", "llama.cpp") if r % 2 == 0 else ("llama.cpp", "baton")):
                res = children[name].run()
                got[name].append(res["tok_s"])
                last[name] = res["tokens"]
                print(f"batch 1 round {r + 1}: {name:9s} {res['tok_s']:7.1f} tok/s", flush=True)
    finally:
        for child in children.values():
            child.close()
    (bb, bm), (lb, lm) = best_and_median(got["baton"]), best_and_median(got["llama.cpp"])
    label = f"Baton {args.dtype}" + (f" {args.quantization}" if args.quantization else "")
    print(f"batch 1, {len(prompt)}-token prompt, {args.tokens} tokens, {args.threads} threads: "
          f"{label} best {bb:.1f} median {bm:.1f} tok/s; llama.cpp best {lb:.1f} median "
          f"{lm:.1f} tok/s; Baton / llama.cpp {bb / lb:.2f}x (best), {bm / lm:.2f}x (median); "
          f"greedy tokens agree for the first {leading_agreement(last['baton'], last['llama.cpp'])}"
          f" of {args.tokens}", flush=True)


# ---- W1 through the OpenAI servers --------------------------------------------------------


def wait_http(base: str, proc: subprocess.Popen, timeout: float) -> str:
    """Until GET /v1/models answers; returns the served model's name."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server for {base} exited with {proc.returncode}")
        try:
            r = httpx.get(f"{base}/v1/models", timeout=2)
            if r.status_code == 200:
                return r.json()["data"][0]["id"]
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{base} did not answer in {timeout:.0f}s")


async def load(system: str, base: str, model: str, prompts: list[str], output_len: int,
               concurrency: int) -> tuple[int, float, int]:
    """(output tokens, seconds, requests short of output_len) of every prompt sent,
    `concurrency` at a time."""
    import httpx

    queue: asyncio.Queue = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    counts: list[int] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base, timeout=3600, limits=limits) as client:

        async def worker():
            while not queue.empty():
                body = completion_body(system, model, queue.get_nowait(), output_len)
                r = await client.post("/v1/completions", json=body)
                r.raise_for_status()
                counts.append(completion_tokens(r.json()))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        seconds = time.perf_counter() - t0
    return sum(counts), seconds, sum(1 for c in counts if c < output_len)


def serve_once(system: str, args: argparse.Namespace, prompts: list[str],
               output_len: int) -> float:
    from baton.services.rpc.processes import spawn, stop_all, wait_healthy

    from .serve import ENV

    http = free_port()
    log = tempfile.TemporaryFile()  # the server's output, shown if it fails
    if system == "baton":
        grpc_address = f"127.0.0.1:{free_port()}"
        proc = spawn("colocated", grpc_address, baton_serve_flags(args, http), env=ENV,
                     stdout=log, stderr=log)
    else:
        proc = subprocess.Popen(llama_server_cmd(args, http), cwd=tempfile.gettempdir(),
                                stdout=log, stderr=log, start_new_session=True)
    try:
        if system == "baton":
            wait_healthy(grpc_address, proc, SERVER_START_S)
        base = f"http://127.0.0.1:{http}"
        model = wait_http(base, proc, SERVER_START_S)
        asyncio.run(load(system, base, model, prompts[:1], 4, 1))  # warm-up
        tokens, seconds, short = asyncio.run(load(system, base, model, prompts, output_len,
                                                  args.concurrency))
    except BaseException:
        log.seek(0)
        print(f"{system} server output:\n{log.read()[-4000:].decode(errors='replace')}",
              file=sys.stderr)
        raise
    finally:
        stop_all([proc])
        log.close()
    note = f" ({short} requests ended short of {output_len} tokens)" if short else ""
    print(f"W1 {system:9s} {tokens / seconds:7.1f} output tok/s ({tokens} tokens in "
          f"{seconds:.1f} s){note}", flush=True)
    return tokens / seconds


def w1(args: argparse.Namespace, tokenizer) -> None:
    from .machine import cpu_line, trim
    from .workloads import make_workload

    if args.only == "w1":
        print(cpu_line())

    wl = trim(make_workload("w1", len(tokenizer)), args.w1_requests)
    output_len = args.w1_output or wl.output_len
    prompts = [tokenizer.decode(ids) for ids in wl.prompts]
    retok = sum(len(tokenizer.encode(p, add_special_tokens=False)) for p in prompts)
    print(f"{wl.name}: {len(prompts)} prompts as text ({sum(map(len, wl.prompts))} ids, "
          f"{retok} tokens re-tokenized), {output_len} tokens each, concurrency "
          f"{args.concurrency}, {args.threads} threads each", flush=True)
    got: dict[str, list[float]] = {"baton": [], "llama.cpp": []}
    for r in range(args.serve_rounds):
        for system in (("baton", "llama.cpp") if r % 2 == 0 else ("llama.cpp", "baton")):
            got[system].append(serve_once(system, args, prompts, output_len))
    b, ll = statistics.median(got["baton"]), statistics.median(got["llama.cpp"])
    print(f"W1 total output tok/s: Baton {b:.1f}, llama.cpp {ll:.1f}; Baton / llama.cpp "
          f"{b / ll:.2f}x", flush=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        baton_child(args)
        return
    if not Path(args.llama_python).exists():
        sys.exit(f"llama.cpp is not installed at {args.llama_python}: `make llamacpp`")
    from baton.services.common.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(Path(args.model))
    prompt = tokenizer.encode(PROMPT, add_special_tokens=False)
    if args.only != "w1":
        batch1(args, prompt)
    if args.only != "batch1":
        w1(args, tokenizer)


if __name__ == "__main__":
    main()

"""`baton up` (and `make serve`): the whole topology on one machine. Starts a prefill and a
decode worker with every engine flag given here, waits until both answer health checks,
starts the router, waits for it, prints how to call it, and stays in the foreground. The
three share a cluster token made for the run (or the one given).
Ctrl-C or SIGTERM stops every process it started; if any of them dies, the rest stop too."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time

from baton.router.config import RouterConfig
from baton.services.rpc.config import ServiceConfig, is_loopback
from baton.services.rpc.processes import dial, spawn, stop_all, wait_healthy
from baton.services.rpc.security import client_credentials, load_keys

from .exposure import address, open_to_anyone, reachable
from .flags import Flag, add_flags, argv_for


def add_parser(sub, with_flags: bool) -> list[Flag]:
    p = sub.add_parser("up", help="run router + prefill + decode on this machine")
    p.add_argument("--port", type=int, default=50051, help="the router's gRPC port")
    p.add_argument("--http-port", type=int, default=8000,
                   help="the router's OpenAI-compatible HTTP port (and /metrics)")
    p.add_argument("--prefill-port", type=int, default=50061)
    p.add_argument("--decode-port", type=int, default=50071)
    p.add_argument("--prefill-metrics-port", type=int, default=8061)
    p.add_argument("--decode-metrics-port", type=int, default=8071)
    p.add_argument("--host", default="127.0.0.1",
                   help="where every service listens (default: this machine only; "
                   "0.0.0.0: every interface, and then set --api-key)")
    p.add_argument("--api-key", action="append",
                   help="callers must send `Authorization: Bearer <key>` (repeat, or "
                   "comma-separate) [BATON_API_KEY, else VLLM_API_KEY; BATON_API_KEY_FILE "
                   "adds a file's]")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--plan", help="a plan from `baton plan --out`: its workers per role "
                   "(on consecutive ports from --prefill-port and --decode-port, each on "
                   "cores of its own when this machine has enough) and the router's flags")
    for role in ("prefill", "decode"):
        p.add_argument(f"--{role}-tensor-parallel-size", type=int, default=None,
                       help=f"the {role} worker's --tensor-parallel-size (default: "
                       "--tensor-parallel-size)")
    return add_flags(p, ("prefill", "decode")) if with_flags else []


def up(args, flags: list[Flag]) -> None:
    procs: list[subprocess.Popen] = []
    stopping = False

    def on_signal(signum, frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    dial = reachable(args.host)
    router = address(dial, args.port)
    names: dict[int, str] = {}
    keys = api_keys(args)
    # Its workers share a cluster token (below): only the router can be open to anyone.
    open_router = open_to_anyone("router", ServiceConfig(address(args.host, args.port)),
                                 RouterConfig(api_keys=keys))
    if open_router is not None:
        print(f"baton up: WARNING: {open_router}", file=sys.stderr, flush=True)
    env = cluster_env(args)
    try:
        started = planned_workers(args)
        metrics = {"prefill": args.prefill_metrics_port, "decode": args.decode_metrics_port}
        addresses: dict[str, list[str]] = {"prefill": [], "decode": []}
        for role, port, metrics_port, own in started:
            proc = spawn(role, address(args.host, port), [
                *argv_for(args, flags, role), *own, "--metrics-port", str(metrics_port)],
                env=env)
            procs.append(proc)
            names[proc.pid] = role
            addresses[role].append(address(dial, port))
        mutual = client_credentials(args.tls_ca, args.tls_cert, args.tls_key)
        for proc, (_, port, _, _) in zip(procs, started, strict=True):
            wait_healthy(address(dial, port), proc, args.startup_timeout, mutual)
        prefill, decode = addresses["prefill"], addresses["decode"]
        router_flags, router_env = router_launch(args, flags, prefill, decode, env)
        proc = spawn("router", address(args.host, args.port), router_flags, env=router_env)
        procs.append(proc)
        names[proc.pid] = "router"
        wait_healthy(router, proc, args.startup_timeout,
                     client_credentials(args.tls_ca) if args.tls_cert else None)
        key = keys[0] if keys else None  # the banner's own call (never shown)
        print(banner(args, metrics, served_name(router, key, args.tls_cert and args.tls_ca),
                     keyed=bool(keys)), flush=True)
        while not stopping:
            dead = [p for p in procs if p.poll() is not None]
            if dead:
                print(f"the {names[dead[0].pid]} exited with code {dead[0].returncode}; "
                      "stopping the rest", file=sys.stderr)
                break
            time.sleep(0.5)
    except (RuntimeError, TimeoutError) as e:
        print(f"baton up: {e}", file=sys.stderr)
    finally:  # the router first: the workers finish what it sends them meanwhile
        stop_all([p for p in procs if names.get(p.pid) == "router"])
        stop_all([p for p in procs if names.get(p.pid) != "router"])
    if not stopping:
        sys.exit(1)


def load_plan(path: str) -> dict:
    import json

    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise RuntimeError(f"--plan {path}: {e}") from None


def planned_workers(args) -> list[tuple[str, int, int, list[str]]]:
    """(role, port, metrics port, its own flags) of each worker to start: one prefill
    and one decode worker, or a plan's (`baton plan --out`): each role's replicas on
    consecutive ports from --prefill-port and --decode-port (metrics ports likewise),
    with the role's flags, and each on cores of its own (--cpus) when this machine has
    enough for them all (else they share them: a warning says so)."""
    if not getattr(args, "plan", None):
        out = []
        for role in ("prefill", "decode"):
            tp = getattr(args, f"{role}_tensor_parallel_size", None)
            own = ["--tensor-parallel-size", str(tp)] if tp else []
            out.append((role, getattr(args, f"{role}_port"),
                        getattr(args, f"{role}_metrics_port"), own))
        return out
    roles = load_plan(args.plan).get("roles", {})
    if not roles.get("decode", {}).get("replicas"):
        raise RuntimeError(f"--plan {args.plan}: it has no decode worker")
    first = {"prefill": (args.prefill_port, args.prefill_metrics_port),
             "decode": (args.decode_port, args.decode_metrics_port)}
    n = roles.get("prefill", {}).get("replicas", 0)
    if n > args.decode_port - args.prefill_port or \
            n > args.decode_metrics_port - args.prefill_metrics_port:
        raise RuntimeError(f"--plan: {n} prefill workers' ports run into the decode "
                           "workers': set --decode-port and --decode-metrics-port higher")
    cores = sorted(os.sched_getaffinity(0))
    need = sum(r["replicas"] * r.get("threads", 1) * r.get("tensor_parallel", 1)
               for r in roles.values())
    if need > len(cores):
        print(f"baton up: WARNING: the plan's workers need {need} cores, this machine "
              f"lets us use {len(cores)}: they share them", file=sys.stderr, flush=True)
    out, next_core = [], 0
    for role in ("prefill", "decode"):
        r = roles.get(role)
        if not r:
            continue
        per = r.get("threads", 1) * r.get("tensor_parallel", 1)
        for i in range(r["replicas"]):
            own = list(r.get("flags", []))
            if need <= len(cores):
                own += ["--cpus", ",".join(map(str, cores[next_core:next_core + per]))]
                next_core += per
            out.append((role, first[role][0] + i, first[role][1] + i, own))
    return out


def cluster_env(args) -> dict[str, str]:
    """The environment of the three processes: they share a cluster token (the one
    given, else a fresh one for this run) through a variable, as `ps` shows argv; a
    token file's path goes on the command line instead."""
    env = {k: v for k, v in os.environ.items() if k != "BATON_CLUSTER_TOKEN"}
    if not args.cluster_token_file:
        env["BATON_CLUSTER_TOKEN"] = args.cluster_token or secrets.token_urlsafe(32)
    return env


def given_keys(args) -> list[str]:
    """--api-key (or BATON_API_KEY), comma-separated or repeated; else VLLM_API_KEY, one
    key (as vLLM reads it)."""
    if not args.api_key and "BATON_API_KEY" not in os.environ:
        key = os.environ.get("VLLM_API_KEY", "").strip()
        return [key] if key else []
    given = args.api_key or [os.environ["BATON_API_KEY"]]
    return [k.strip() for v in given for k in v.split(",") if k.strip()]


def api_keys(args) -> tuple[str, ...]:
    """Every key the router takes: the given ones, then BATON_API_KEY_FILE's (which the
    router reads too)."""
    return load_keys(given_keys(args), os.environ.get("BATON_API_KEY_FILE"))


def router_launch(args, flags: list[Flag], prefill: list[str], decode: list[str],
                  env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The router's flags and environment: every flag the router takes too (TLS, traces,
    drain grace, model), the workers, a plan's router flags, and the API keys, in a
    variable (as `ps` shows argv)."""
    workers = [f for a in prefill for f in ("--prefill", a)] + [
        f for a in decode for f in ("--decode", a)]
    plan = load_plan(args.plan) if getattr(args, "plan", None) else {}
    argv = [*argv_for(args, flags, "router"), *workers, *plan.get("router", {}).get("flags", []),
            "--http-port", str(args.http_port)]
    env = {k: v for k, v in env.items() if k != "BATON_API_KEY"}
    if args.api_key or "BATON_API_KEY" in os.environ:  # else VLLM_API_KEY, as it is
        env["BATON_API_KEY"] = ",".join(given_keys(args))
    return argv, env


def served_name(router: str, api_key: str | None, ca: str | None = None) -> str:
    """The model's name in the OpenAI API, as the router says it."""
    from baton.v1 import generation_pb2 as gen
    from baton.v1 import generation_pb2_grpc as gen_grpc

    with dial(router, client_credentials(ca)) as channel:
        metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        info = gen_grpc.GenerationStub(channel).GetModelInfo(
            gen.GetModelInfoRequest(), metadata=metadata, timeout=10).info
    return info.served_model_name or info.model.removesuffix(".gguf")


def banner(args, metrics: dict[str, int], model: str, keyed: bool = False) -> str:
    """How to call the services. With API keys, the calls read the key from
    $BATON_API_KEY: a banner goes to terminals, logs and screenshots, a key must not."""
    host = reachable(args.host)
    host = "localhost" if is_loopback(host) else host
    http, grpc_at = f"http://{address(host, args.http_port)}", address(host, args.port)
    key = ' -H "Authorization: Bearer $BATON_API_KEY"' if keyed else ""
    grpc_key = ' -H "authorization: Bearer $BATON_API_KEY"' if keyed else ""
    chat = f'{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}]}}'
    imports, sdk_key = ("os, openai", "os.environ['BATON_API_KEY']") if keyed else (
        "openai", "'none'")
    sdk = (f"import {imports}; c = openai.OpenAI(base_url='{http}/v1', api_key={sdk_key}); "
           "print(c.chat.completions.create(model=c.models.list().data[0].id, "
           "messages=[{'role': 'user', 'content': 'Hello!'}]).choices[0].message.content)")
    where_key = (["These read an API key of the router from $BATON_API_KEY: export it first.",
                  ""] if keyed else [])
    return "\n".join([
        "",
        f"Baton is up: the OpenAI API on {http}/v1, gRPC on {grpc_at}",
        f"(prefill :{args.prefill_port}, decode :{args.decode_port}; /metrics on "
        f":{args.http_port}, :{metrics['prefill']} and :{metrics['decode']}). Try:",
        "",
        *where_key,
        f"  curl {http}/v1/chat/completions{key} -H 'Content-Type: application/json' \\",
        f"    -d '{chat}'",
        "",
        f'  .venv/bin/python -c "{sdk}"',
        "",
        "  .venv/bin/baton generate --chat 'What is the capital of France?' "
        f"--address {grpc_at}",
        f"  grpcurl -plaintext{grpc_key} -d '{{\"text\": \"Hello\"}}' {grpc_at} "
        "baton.v1.Generation/Generate",
        "",
        "Ctrl-C stops everything.",
        ""])

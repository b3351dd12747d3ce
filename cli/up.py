"""`baton up` (and `make serve`): the whole topology on one machine. Starts a prefill and a
decode worker with every engine flag given here, waits until both answer health checks,
starts the router, waits for it, prints how to call it, and stays in the foreground.
Ctrl-C or SIGTERM stops every process it started; if any of them dies, the rest stop too."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from cli.flags import Flag, add_flags, argv_for
from services.serving.processes import spawn, stop_all, wait_healthy
from services.serving.security import client_credentials


def add_parser(sub, with_flags: bool) -> list[Flag]:
    p = sub.add_parser("up", help="run router + prefill + decode on this machine")
    p.add_argument("--port", type=int, default=50051, help="the router's gRPC port")
    p.add_argument("--http-port", type=int, default=8000,
                   help="the router's OpenAI-compatible HTTP port (and /metrics)")
    p.add_argument("--prefill-port", type=int, default=50061)
    p.add_argument("--decode-port", type=int, default=50071)
    p.add_argument("--prefill-metrics-port", type=int, default=8061)
    p.add_argument("--decode-metrics-port", type=int, default=8071)
    p.add_argument("--api-key", help="callers must send `Authorization: Bearer <key>`")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    return add_flags(p, ("prefill", "decode")) if with_flags else []


def up(args, flags: list[Flag]) -> None:
    procs: list[subprocess.Popen] = []
    stopping = False

    def on_signal(signum, frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    prefill, decode = f"127.0.0.1:{args.prefill_port}", f"127.0.0.1:{args.decode_port}"
    router = f"127.0.0.1:{args.port}"
    names: dict[int, str] = {}
    try:
        metrics = {"prefill": args.prefill_metrics_port, "decode": args.decode_metrics_port}
        for role, address in (("prefill", prefill), ("decode", decode)):
            proc = spawn(role, address, [*argv_for(args, flags, role), "--metrics-port",
                                         str(metrics[role])])
            procs.append(proc)
            names[proc.pid] = role
        mutual = client_credentials(args.tls_ca, args.tls_cert, args.tls_key)
        wait_healthy(prefill, procs[0], args.startup_timeout, mutual)
        wait_healthy(decode, procs[1], args.startup_timeout, mutual)
        # Every flag the router takes too (TLS, traces, drain grace, model) goes to it.
        router_flags = [*argv_for(args, flags, "router"), "--prefill", prefill, "--decode",
                        decode, "--http-port", str(args.http_port)]
        if args.api_key:
            router_flags += ["--api-key", args.api_key]
        proc = spawn("router", router, router_flags)
        procs.append(proc)
        names[proc.pid] = "router"
        wait_healthy(router, proc, args.startup_timeout,
                     client_credentials(args.tls_ca) if args.tls_cert else None)
        print(banner(args, metrics, served_name(router, args.api_key, args.tls_cert and
                                                args.tls_ca)), flush=True)
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


def served_name(router: str, api_key: str | None, ca: str | None = None) -> str:
    """The model's name in the OpenAI API, as the router says it."""
    import grpc

    from baton.v1 import generation_pb2 as gen
    from baton.v1 import generation_pb2_grpc as gen_grpc

    creds = client_credentials(ca)
    channel = (grpc.secure_channel(router, creds) if creds is not None
               else grpc.insecure_channel(router))
    with channel:
        metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        info = gen_grpc.GenerationStub(channel).GetModelInfo(
            gen.GetModelInfoRequest(), metadata=metadata, timeout=10).info
    return info.served_model_name or info.model.removesuffix(".gguf")


def banner(args, metrics: dict[str, int], model: str) -> str:
    http, grpc_port = f"http://localhost:{args.http_port}", args.port
    key = f" -H 'Authorization: Bearer {args.api_key}'" if args.api_key else ""
    tool_key = f" --api-key {args.api_key}" if args.api_key else ""
    chat = f'{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}]}}'
    sdk = (f"import openai; c = openai.OpenAI(base_url='{http}/v1', "
           f"api_key='{args.api_key or 'none'}'); "
           "print(c.chat.completions.create(model=c.models.list().data[0].id, "
           "messages=[{'role': 'user', 'content': 'Hello!'}]).choices[0].message.content)")
    return "\n".join([
        "",
        f"Baton is up: the OpenAI API on {http}/v1, gRPC on localhost:{grpc_port}",
        f"(prefill :{args.prefill_port}, decode :{args.decode_port}; /metrics on "
        f":{args.http_port}, :{metrics['prefill']} and :{metrics['decode']}). Try:",
        "",
        f"  curl {http}/v1/chat/completions{key} -H 'Content-Type: application/json' \\",
        f"    -d '{chat}'",
        "",
        f'  .venv/bin/python -c "{sdk}"',
        "",
        "  .venv/bin/baton generate --chat 'What is the capital of France?' "
        f"--address localhost:{grpc_port}{tool_key}",
        f"  grpcurl -plaintext -d '{{\"text\": \"Hello\"}}' localhost:{grpc_port} "
        "baton.v1.Generation/Generate",
        "",
        "Ctrl-C stops everything.",
        ""])

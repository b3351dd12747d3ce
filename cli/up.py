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


def add_parser(sub, with_flags: bool) -> list[Flag]:
    p = sub.add_parser("up", help="run router + prefill + decode on this machine")
    p.add_argument("--port", type=int, default=50051, help="the router's port")
    p.add_argument("--prefill-port", type=int, default=50061)
    p.add_argument("--decode-port", type=int, default=50071)
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
        for role, address in (("prefill", prefill), ("decode", decode)):
            proc = spawn(role, address, argv_for(args, flags, role))
            procs.append(proc)
            names[proc.pid] = role
        wait_healthy(prefill, procs[0], args.startup_timeout)
        wait_healthy(decode, procs[1], args.startup_timeout)
        router_flags = ["--prefill", prefill, "--decode", decode]
        if args.model:
            router_flags += ["--model", args.model]
        proc = spawn("router", router, router_flags)
        procs.append(proc)
        names[proc.pid] = "router"
        wait_healthy(router, proc, args.startup_timeout)
        print(f"\nBaton is up: router on localhost:{args.port} (prefill :{args.prefill_port}, "
              f"decode :{args.decode_port}).\nTry:\n"
              f"  .venv/bin/baton generate --chat 'What is the capital of France?' "
              f"--address localhost:{args.port}\n"
              f"  grpcurl -plaintext -d '{{\"text\": \"Hello\"}}' localhost:{args.port} "
              "baton.v1.Generation/Generate\nCtrl-C stops everything.\n", flush=True)
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

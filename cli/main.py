"""The `baton` command.

    baton serve [MODEL] [--role router|prefill|decode|colocated]
                                                           one service, in the foreground
                                                           (default: colocated, as vllm serve)
    baton up                                               router + prefill + decode locally
    baton generate "prompt"                                stream a completion to stdout
    baton health ADDRESS                                   exit 0 if it answers SERVING
    baton bench goodput ...                                goodput at an SLO over request
                                                           rates (tools/bench/goodput.py)
    baton profile ...                                      this machine's step and hand-off
                                                           costs (tools/plan/profile.py)
    baton plan ...                                         the topology for a workload and
                                                           an SLO (tools/plan/planner.py)

Every flag of `serve` and `up` has a BATON_* variable (cli/flags.py). A role's modules
load only when it runs, so the router never loads the engine (or torch).
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
import uuid

from . import generate, up
from .exposure import address as join_address
from .exposure import warn_if_open
from .flags import DEFAULT_PORTS, ROLES, WORKERS, Flag, add_flags, fail, values

DEFAULT_ROLE = "colocated"  # `baton serve MODEL`, as `vllm serve MODEL`
BENCHMARKS = ("goodput",)  # `baton bench NAME`: baton.tools.bench.NAME's main(argv)
# Commands that parse their own arguments: the module whose main(argv) runs.
PASSED_ON = {"profile": "baton.tools.plan.profile", "plan": "baton.tools.plan.planner"}


def _role_in(argv: list[str]) -> str | None:
    """The --role of a serve command line (or BATON_ROLE, else colocated), to show that
    role's flags; None for a role that is not one (argparse then says so)."""
    for i, arg in enumerate(argv):
        if arg == "--role" and i + 1 < len(argv):
            return argv[i + 1] if argv[i + 1] in ROLES else None
        if arg.startswith("--role="):
            value = arg.split("=", 1)[1]
            return value if value in ROLES else None
    role = os.environ.get("BATON_ROLE") or DEFAULT_ROLE
    return role if role in ROLES else None


def _serve_parser(sub, role: str | None) -> list[Flag]:
    p = sub.add_parser("serve", help="run one service (default: colocated)",
                       description="Run one Baton service in the foreground: `baton serve "
                       "MODEL` serves MODEL from one process, as `vllm serve MODEL` does. "
                       "--help lists the flags of the role given (default: colocated).")
    p.add_argument("model_tag", nargs="?", metavar="MODEL",
                   help="the model to serve: the same as --model")
    p.add_argument("--role", choices=ROLES,
                   default=os.environ.get("BATON_ROLE") or DEFAULT_ROLE,
                   help=f"[BATON_ROLE; default: {DEFAULT_ROLE}]")
    p.add_argument("--address", default=os.environ.get("BATON_ADDRESS"),
                   help="host:port of the gRPC API [BATON_ADDRESS; default: the role's port "
                   f"{DEFAULT_PORTS}, on 0.0.0.0 for the router and colocated, on "
                   "127.0.0.1 for prefill and decode workers]")
    p.add_argument("--host", default=os.environ.get("BATON_HOST"),
                   help="the host every port of the service listens on (gRPC, the HTTP API, "
                   "/metrics): replaces the host of --address [BATON_HOST]")
    p.add_argument("--log-level", default=os.environ.get("BATON_LOG_LEVEL", "INFO"),
                   help="[BATON_LOG_LEVEL; default: INFO]")
    return add_flags(p, (role,) if role else ROLES)


def _serve(args, flags: list[Flag]) -> None:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    role = args.role
    address = serve_address(args)
    given = values(args, flags, role)
    try:
        from baton.router.config import RouterConfig
        from baton.services.common.limits import Limits
        from baton.services.rpc.config import ServiceConfig

        service = ServiceConfig(address=address, **given["service"])
        router = RouterConfig(service=service, limits=Limits(**given["limits"]),
                              **given["router"])
        if role == "router" and not router.decode:
            fail("the router needs --decode addresses (and usually --prefill ones)")
        if role in WORKERS:
            from baton.services.engine.config import EngineConfig, SpecConfig
            from baton.services.worker.config import WorkerConfig

            engine = EngineConfig(speculative=SpecConfig(**given["spec"]), **given["engine"])
            worker = dict(given["worker"])
            # Unique per start, so a restarted worker is never taken for its old self
            # (its pairs, its peers' NIXL metadata and its lease ids start anew).
            worker["engine_id"] = f"{worker.get('engine_id') or role}-{uuid.uuid4().hex[:8]}"
            if role != "colocated" and not worker.get("kv_transport"):
                from baton.kv_transfer.connectors import default_transport

                worker["kv_transport"] = default_transport()
            config = WorkerConfig(engine=engine, service=service, **worker)
            if role != "colocated":  # before the model loads: one line, at once
                config.check_cluster_auth()
    except ValueError as e:
        fail(str(e))
    warn_if_open(role, service, router)
    try:
        if role == "router":
            from baton.router.server import serve

            serve(router)
        elif role == "prefill":
            from baton.prefill_worker.server import serve

            serve(config)
        elif role == "decode":
            from baton.decode_worker.server import serve

            serve(config)
        else:
            from .colocated import serve

            serve(config, router)
    finally:
        # The service has stopped: what is left is freed as the process exits. Python's
        # last garbage collection walks every object (torch's and transformers' modules,
        # a second of a stop); frozen, it walks none.
        gc.freeze()


def serve_address(args: argparse.Namespace) -> str:
    """Where a served role's gRPC API listens: --address (or the role's default port: on
    every interface for the public API, on loopback for a worker), on --host when it is
    given."""
    host = "127.0.0.1" if args.role in ("prefill", "decode") else "0.0.0.0"
    address = args.address or f"{host}:{DEFAULT_PORTS[args.role]}"
    if not args.host:
        return address
    port = address.rsplit(":", 1)[1] if ":" in address else ""
    if not port.isdigit():
        fail(f"--address {address!r}: host:port, with a port number")
    return join_address(args.host, int(port))


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[Flag]]:
    """The command line (and, for serve and up, the BATON_* variables): the arguments,
    and the flags of the command that runs."""
    command = argv[0] if argv else None
    parser = argparse.ArgumentParser(prog="baton", description=(__doc__ or "").split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    # Flags (and their variables) are read only for the command that runs.
    if command == "serve":
        flags = _serve_parser(sub, _role_in(argv))
    else:
        sub.add_parser("serve", help="run one service")
        flags = []
    up_flags = up.add_parser(sub, with_flags=command == "up")
    generate.add_parser(sub)
    health = sub.add_parser("health", help="check a service's grpc.health.v1 status")
    health.add_argument("address")
    for name in ("ca", "cert", "key"):  # a worker with mutual TLS wants a certificate
        health.add_argument(f"--tls-{name}", default=os.environ.get(f"BATON_TLS_{name.upper()}"))
    bench = sub.add_parser("bench", help="a benchmark (goodput: see `baton bench goodput "
                           "--help`)", add_help=False)
    bench.add_argument("benchmark", choices=BENCHMARKS)
    sub.add_parser("profile", help="measure this machine's engine steps and hand-offs (see "
                   "`baton profile --help`)", add_help=False)
    sub.add_parser("plan", help="choose a topology for a workload and an SLO (see "
                   "`baton plan --help`)", add_help=False)
    if command in ("bench", *PASSED_ON):  # the module parses the rest itself
        args, rest = parser.parse_known_args(argv)
        args.rest = rest
        return args, []
    args = parser.parse_args(argv)
    if command == "serve" and args.model_tag:  # `baton serve MODEL`: MODEL is --model
        if args.model not in (None, args.model_tag):
            fail(f"two models: {args.model_tag!r}, and {args.model!r} from --model or "
                 "BATON_MODEL; give one")
        args.model = args.model_tag
    return args, flags or up_flags


def main(argv: list[str] | None = None) -> None:
    args, flags = parse(sys.argv[1:] if argv is None else list(argv))
    if args.command == "serve":
        _serve(args, flags)
    elif args.command == "up":
        up.up(args, flags)
    elif args.command == "bench":
        from importlib import import_module

        import_module(f"baton.tools.bench.{args.benchmark}").main(args.rest)
    elif args.command in PASSED_ON:
        from importlib import import_module

        import_module(PASSED_ON[args.command]).main(args.rest)
    elif args.command == "health":
        from baton.services.rpc.processes import is_serving
        from baton.services.rpc.security import client_credentials

        creds = client_credentials(args.tls_ca, args.tls_cert, args.tls_key)
        sys.exit(0 if is_serving(args.address, credentials=creds) else 1)
    else:
        generate.generate(args)


if __name__ == "__main__":
    main()

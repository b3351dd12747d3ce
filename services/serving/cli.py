"""The `baton` command.

    baton serve --role router|prefill|decode|colocated   one service, in the foreground
    baton up                                               router + prefill + decode locally
    baton generate "prompt"                                stream a completion to stdout
    baton health ADDRESS                                   exit 0 if it answers SERVING

Flags default to BATON_* environment variables (for docker compose). Each role's module
is imported by name, so the router never loads the engine (or torch).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import uuid

ROLES = {"router": "router.server", "prefill": "prefill_worker.server",
         "decode": "decode_worker.server", "colocated": "services.worker.colocated"}
DEFAULT_PORTS = {"router": 50051, "prefill": 50061, "decode": 50071, "colocated": 50051}


def _split(value: str | None) -> list[str]:
    return [v.strip() for v in (value or "").split(",") if v.strip()]


def _serve_parser(sub) -> None:
    env = os.environ.get
    p = sub.add_parser("serve", help="run one service")
    p.add_argument("--role", choices=sorted(ROLES), default=env("BATON_ROLE"), required=not
                   env("BATON_ROLE"))
    p.add_argument("--address", default=env("BATON_ADDRESS"),
                   help="host:port to listen on (default 0.0.0.0:<the role's port>)")
    p.add_argument("--engine-id", default=env("BATON_ENGINE_ID"))
    p.add_argument("--prefill", action="append", default=_split(env("BATON_PREFILL")),
                   help="router: a prefill worker address (repeat, or comma-separate)")
    p.add_argument("--decode", action="append", default=_split(env("BATON_DECODE")),
                   help="router: a decode worker address (repeat, or comma-separate)")
    p.add_argument("--max-inflight", type=int,
                   default=int(env("BATON_MAX_INFLIGHT", "256")),
                   help="router: requests in flight at once; past it, RESOURCE_EXHAUSTED")
    p.add_argument("--request-timeout", type=float,
                   default=float(env("BATON_REQUEST_TIMEOUT", "600")),
                   help="router: the deadline of a request whose client set none")
    p.add_argument("--kv-transport", choices=["nixl", "grpc"],
                   default=env("BATON_KV_TRANSPORT"))
    p.add_argument("--kv-lease-timeout", type=float,
                   default=float(env("BATON_KV_LEASE_TIMEOUT", "30")))
    p.add_argument("--kv-load-failure-policy", choices=["recompute", "fail"],
                   default=env("BATON_KV_LOAD_FAILURE_POLICY", "recompute"),
                   help="decode: when a KV pull fails, prefill locally, or fail the request")
    p.add_argument("--inject-kv-failure", default=env("BATON_INJECT_KV_FAILURE"),
                   help=argparse.SUPPRESS)  # test hook: every KV pull fails with this reason
    p.add_argument("--drain-grace", type=float,
                   default=float(env("BATON_DRAIN_GRACE", "30")),
                   help="on SIGTERM: seconds in-flight requests get to finish")
    p.add_argument("--log-level", default=env("BATON_LOG_LEVEL", "INFO"))
    from services.serving.flags import add_engine_flags

    add_engine_flags(p)


def _serve(args) -> None:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args.address = args.address or f"0.0.0.0:{DEFAULT_PORTS[args.role]}"
    args.engine_id = args.engine_id or f"{args.role}-{uuid.uuid4().hex[:8]}"
    args.prefill = [a for v in args.prefill for a in _split(v)]
    args.decode = [a for v in args.decode for a in _split(v)]
    if args.role == "router" and (not args.prefill or not args.decode):
        sys.exit("baton serve --role router needs --prefill and --decode addresses")
    if args.kv_transport is None and args.role in ("prefill", "decode"):
        args.kv_transport = importlib.import_module("kv_transfer").default_transport()
    importlib.import_module(ROLES[args.role]).serve(args)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="baton", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    from services.serving import client, launcher

    launcher.add_parser(sub)
    client.add_parser(sub)
    health = sub.add_parser("health", help="check a service's grpc.health.v1 status")
    health.add_argument("address")
    args = parser.parse_args(argv)
    if args.command == "serve":
        _serve(args)
    elif args.command == "up":
        launcher.up(args)
    elif args.command == "health":
        sys.exit(0 if launcher.is_serving(args.address) else 1)
    else:
        client.generate(args)


if __name__ == "__main__":
    main()

"""Whether a service is open to anyone who reaches it: one that listens beyond loopback
with nothing that says who may call. A router (or colocated) without API keys serves
anyone's requests: `baton serve` and `baton up` say so loudly, and still start. A
prefill or decode worker with neither a cluster token nor mutual TLS would take anyone's
calls (a Decode that pulls from a prefill address of the caller's choice, adapter loads,
KV reads): it refuses to start (WorkerConfig.check_cluster_auth), unless
--insecure-no-cluster-auth says otherwise, and then it says so as loudly."""

from __future__ import annotations

import logging

from baton.router.config import RouterConfig
from baton.services.rpc.config import ServiceConfig

log = logging.getLogger("baton")
WILDCARDS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


def reachable(host: str) -> str:
    """The host to dial a service that listens on `host` from this machine."""
    return WILDCARDS.get(host.strip("[]"), host)


def address(host: str, port: int) -> str:
    host = host.strip("[]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def open_to_anyone(role: str, service: ServiceConfig, router: RouterConfig | None = None
                   ) -> str | None:
    """Why a `role` service with these settings serves anyone who reaches it, or None."""
    if service.local_only:
        return None
    where = f"the {role} listens on {service.host} (beyond this machine)"
    if role in ("router", "colocated"):
        if router is not None and (router.api_keys or router.api_key_file):
            return None
        return (f"{where} with no API key: anyone who reaches it can send requests "
                "(set --api-key or --api-key-file)")
    if service.checks_callers:
        return None
    return (f"{where} with neither a cluster token nor mutual TLS: anyone who reaches it "
            "can call it (set --cluster-token, or --tls-ca with --tls-cert and --tls-key)")


def warn_if_open(role: str, service: ServiceConfig, router: RouterConfig | None = None
                 ) -> str | None:
    """Log `open_to_anyone` as a WARNING, and return it."""
    why = open_to_anyone(role, service, router)
    if why is not None:
        log.warning("%s", why)
    return why

"""Safe defaults that open a socket or a channel: metrics over TLS, traces over TLS unless
told otherwise, the router's keys from `baton up` (the rest: tests/unit/test_safe_defaults.py)."""

from __future__ import annotations

import asyncio
import ssl

import grpc
import httpx
import pytest

from baton.cli import up as up_module
from baton.cli.flags import values
from baton.cli.main import parse
from baton.router.server import GENERATION_METHODS
from baton.services.rpc.config import ServiceConfig
from baton.services.rpc.metrics import serve_metrics
from baton.services.rpc.security import Security
from baton.services.rpc.server import Lifecycle, make_server, service_name
from baton.v1 import generation_pb2 as gen
from baton.v1 import generation_pb2_grpc as gen_grpc
from tests.e2e.certs import CA
from tests.e2e.topology import free_port
from tests.unit.test_safe_defaults import _exporter, _Named


def test_metrics_of_a_service_with_a_certificate_are_served_over_tls(tmp_path):
    ca = CA(tmp_path, "ca")
    cert, key = ca.issue("worker")
    port = free_port()
    server = serve_metrics(ServiceConfig("127.0.0.1:50061", tls_cert=str(cert),
                                         tls_key=str(key), metrics_port=port), [])
    try:
        assert server.server_address[0] == "127.0.0.1"  # not every interface
        verify = ssl.create_default_context(cafile=ca.path)
        assert httpx.get(f"https://127.0.0.1:{port}/metrics", verify=verify,
                         timeout=10).status_code == 200
        with pytest.raises(httpx.HTTPError):  # no plaintext beside it
            httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
    finally:
        server.shutdown()
        server.server_close()
    assert serve_metrics(ServiceConfig(metrics_port=0), []) is None


@pytest.mark.parametrize("env, service, endpoint, insecure", [
    ({}, {"otlp_traces_endpoint": "collector:4317"}, "collector:4317", False),
    ({}, {"otlp_traces_endpoint": "collector:4317", "otlp_insecure": True},
     "collector:4317", True),
    ({"OTEL_EXPORTER_OTLP_TRACES_INSECURE": "true"},
     {"otlp_traces_endpoint": "collector:4317"}, "collector:4317", True),
    ({"OTEL_EXPORTER_OTLP_INSECURE": "true"}, {"otlp_traces_endpoint": "collector:4317"},
     "collector:4317", True),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "https://otel.example:4317"}, {},
     "otel.example:4317", False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://otel.local:4317"}, {}, "otel.local:4317", True),
])
def test_traces_go_over_tls_unless_told_otherwise(monkeypatch, env, service, endpoint,
                                                  insecure):
    exporter = _exporter(monkeypatch, env, **service)
    assert (exporter._endpoint, exporter._insecure) == (endpoint, insecure)


def test_up_gives_the_router_every_key_and_calls_it_with_the_first(monkeypatch):
    monkeypatch.delenv("BATON_API_KEY", raising=False)
    monkeypatch.delenv("BATON_API_KEY_FILE", raising=False)
    args, flags = parse(["up", "--api-key", "a,b", "--api-key", "c"])
    assert up_module.api_keys(args) == ("a", "b", "c")
    argv, env = up_module.router_launch(args, flags, ["127.0.0.1:1"], ["127.0.0.1:2"], {})
    assert not any(k in argv for k in ("a", "b", "c", "a,b"))  # `ps` shows argv
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    router_args, router_flags = parse(["serve", "--role", "router", *argv])
    keys = values(router_args, router_flags, "router")["router"]["api_keys"]
    assert keys == ("a", "b", "c")

    async def main():
        lifecycle = Lifecycle()
        lifecycle.authorize = Security(ServiceConfig(), keys).grpc_check(GENERATION_METHODS)

        def register(server):
            gen_grpc.add_GenerationServicer_to_server(_Named(), server)
            return [service_name(gen, "Generation")]

        server = make_server(register, lifecycle)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        call = asyncio.get_running_loop().run_in_executor
        try:
            assert await call(None, up_module.served_name, f"127.0.0.1:{port}", "a") == "smol"
            with pytest.raises(grpc.RpcError) as e:  # what `up` used to send
                await call(None, up_module.served_name, f"127.0.0.1:{port}", "a,b")
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        finally:
            await server.stop(0)

    asyncio.run(main())

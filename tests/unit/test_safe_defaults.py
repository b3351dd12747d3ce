"""Defaults that are safe: /metrics listens where its service does and over its TLS; a
service that listens beyond loopback with nothing that says who may call warns loudly;
traces go over TLS unless told otherwise and OTel's own variables count; `baton up
--api-key a,b` serves with both keys and its banner's own call passes; API keys never
show in a repr, --help or the banner; vLLM's VLLM_API_KEY counts beside BATON_API_KEY."""

from __future__ import annotations

import logging
import os

import pytest

from baton.cli import up as up_module
from baton.cli.exposure import open_to_anyone
from baton.cli.flags import values
from baton.cli.main import main, parse
from baton.router.config import RouterConfig
from baton.services.rpc import tracing
from baton.services.rpc.config import ServiceConfig
from baton.v1 import generation_pb2 as gen
from baton.v1 import generation_pb2_grpc as gen_grpc

TOKEN = "t" * 32


# ---- /metrics ---------------------------------------------------------------------------

@pytest.mark.parametrize("address, host, bind", [
    ("0.0.0.0:50061", None, "0.0.0.0"), ("127.0.0.1:50061", None, "127.0.0.1"),
    ("[::1]:50061", None, "::1"), (":50061", None, "0.0.0.0"),
    ("127.0.0.1:50061", "10.0.0.7", "10.0.0.7")])
def test_metrics_listen_on_the_services_own_host_unless_told(address, host, bind):
    assert ServiceConfig(address, metrics_port=9090, metrics_host=host).metrics_bind == bind




# ---- open to anyone ---------------------------------------------------------------------

@pytest.mark.parametrize("role, service, router, warns", [
    ("router", ServiceConfig("0.0.0.0:50051"), RouterConfig(), "no API key"),
    ("colocated", ServiceConfig("10.1.2.3:50051"), RouterConfig(), "no API key"),
    ("router", ServiceConfig("0.0.0.0:50051"), RouterConfig(api_keys=("k",)), None),
    ("router", ServiceConfig("127.0.0.1:50051"), RouterConfig(), None),
    ("router", ServiceConfig("localhost:50051"), RouterConfig(), None),
    ("decode", ServiceConfig("0.0.0.0:50071"), None, "neither a cluster token"),
    ("prefill", ServiceConfig("[::]:50061"), None, "neither a cluster token"),
    ("prefill", ServiceConfig("0.0.0.0:50061", cluster_token=TOKEN), None, None),
    ("decode", ServiceConfig("[::1]:50071"), None, None),
])
def test_a_service_beyond_loopback_with_nothing_to_check_callers_says_so(
        role, service, router, warns):
    why = open_to_anyone(role, service, router)
    assert (why is None) if warns is None else (warns in why)


def test_baton_serve_logs_the_warning(monkeypatch, caplog):
    from baton.router import server as router_server

    started = []
    monkeypatch.setattr(router_server, "serve", started.append)
    for keys, warned in (([], True), (["--api-key", "k"], False)):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            main(["serve", "--role", "router", "--decode", "127.0.0.1:1", *keys])
        hits = [r for r in caplog.records if r.levelno == logging.WARNING
                and "no API key" in r.getMessage()]
        assert bool(hits) is warned
    assert len(started) == 2  # it warns, and serves all the same


def test_baton_up_beyond_loopback_without_a_key_warns_on_stderr(monkeypatch, capsys):
    def spawn(*a, **kw):
        raise RuntimeError("not starting processes in a unit test")

    monkeypatch.setattr(up_module, "spawn", spawn)
    monkeypatch.setattr(up_module.signal, "signal", lambda *a: None)
    monkeypatch.delenv("BATON_API_KEY", raising=False)
    monkeypatch.delenv("BATON_API_KEY_FILE", raising=False)
    for argv, warned in ((["--host", "0.0.0.0"], True), (["--host", "0.0.0.0", "--api-key",
                                                          "k"], False), ([], False)):
        args, flags = parse(["up", *argv])
        with pytest.raises(SystemExit):
            up_module.up(args, flags)
        err = capsys.readouterr().err
        assert ("WARNING" in err and "no API key" in err) is warned, err


# ---- traces -----------------------------------------------------------------------------

def _exporter(monkeypatch, env: dict[str, str], **service):
    for name in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT",
                 "OTEL_EXPORTER_OTLP_TRACES_INSECURE", "OTEL_EXPORTER_OTLP_INSECURE",
                 "OTEL_SDK_DISABLED", "OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    options = tracing.exporter_options(ServiceConfig(**service))
    if options is None:
        return None
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    exporter = OTLPSpanExporter(**options)
    exporter.shutdown()
    return exporter




def test_no_endpoint_or_a_disabled_sdk_means_no_traces(monkeypatch):
    assert _exporter(monkeypatch, {}) is None
    assert _exporter(monkeypatch, {"OTEL_SDK_DISABLED": "true"},
                     otlp_traces_endpoint="collector:4317") is None


def test_otel_service_name_names_the_service(monkeypatch):
    _exporter(monkeypatch, {})
    assert tracing.resource("baton-router").attributes["service.name"] == "baton-router"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "edge-router")
    assert tracing.resource("baton-router").attributes["service.name"] == "edge-router"


# ---- baton up --api-key a,b -------------------------------------------------------------

class _Named(gen_grpc.GenerationServicer):
    async def GetModelInfo(self, request, context):
        return gen.GetModelInfoResponse(info=gen.ModelInfo(model="smol.gguf"))




# ---- API keys: never shown; vLLM's variable counts --------------------------------------

SECRET = "s3cret-api-key"


def test_api_keys_never_show_in_a_repr_or_help(monkeypatch, capsys):
    assert SECRET not in repr(RouterConfig(api_keys=(SECRET,)))
    monkeypatch.setenv("BATON_API_KEY", SECRET)
    with pytest.raises(SystemExit):
        parse(["serve", "--role", "router", "--help"])
    out = capsys.readouterr().out
    assert "BATON_API_KEY" in out and SECRET not in out


def test_baton_up_banner_shows_the_variable_never_the_key(monkeypatch, capsys):
    class Exited:  # each child "exits" at once: `up` prints its banner, then stops
        pid, returncode = 1, 0

        def poll(self):
            return 0

    monkeypatch.setattr(up_module, "spawn", lambda *a, **kw: Exited())
    monkeypatch.setattr(up_module, "wait_healthy", lambda *a, **kw: None)
    monkeypatch.setattr(up_module, "stop_all", lambda procs: None)
    monkeypatch.setattr(up_module, "served_name", lambda *a: "smol")
    monkeypatch.setattr(up_module.signal, "signal", lambda *a: None)
    monkeypatch.delenv("BATON_API_KEY_FILE", raising=False)
    args, flags = parse(["up", "--api-key", SECRET])
    with pytest.raises(SystemExit):
        up_module.up(args, flags)
    out = capsys.readouterr().out
    assert "Bearer $BATON_API_KEY" in out and "baton generate" in out
    assert SECRET not in out


@pytest.mark.parametrize("role", ["router", "colocated"])
def test_vllms_api_key_variable_is_honoured_beside_batons(monkeypatch, role):
    from baton.cli import colocated
    from baton.router import server as router_server

    served: list[RouterConfig] = []
    monkeypatch.setattr(router_server, "serve", served.append)
    monkeypatch.setattr(colocated, "serve", lambda worker, router: served.append(router))
    for name in ("BATON_API_KEY", "BATON_API_KEY_FILE", "VLLM_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    argv = ["serve", "--role", role, *(["--decode", "127.0.0.1:1"] if role == "router"
                                       else [])]
    monkeypatch.setenv("VLLM_API_KEY", "vllm,key")  # one key, whole, as vLLM reads it
    main(argv)
    monkeypatch.setenv("BATON_API_KEY", "baton-key")  # Baton's own variable first
    main(argv)
    main([*argv, "--api-key", "flag-key"])  # and the flag before either
    assert [r.api_keys for r in served] == [("vllm,key",), ("baton-key",), ("flag-key",)]


def test_baton_up_hands_vllms_api_key_to_its_router(monkeypatch):
    monkeypatch.delenv("BATON_API_KEY", raising=False)
    monkeypatch.delenv("BATON_API_KEY_FILE", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "vllm,key")
    args, flags = parse(["up"])
    assert up_module.api_keys(args) == ("vllm,key",)
    argv, env = up_module.router_launch(args, flags, ["127.0.0.1:1"], ["127.0.0.1:2"],
                                        dict(os.environ))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    router_args, router_flags = parse(["serve", "--role", "router", *argv])
    assert values(router_args, router_flags, "router")["router"]["api_keys"] == ("vllm,key",)

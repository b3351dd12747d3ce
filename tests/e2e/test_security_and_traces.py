"""A locked-down topology: TLS on every port, mutual TLS between the router and the
workers (certificates made at run time), an API key on the public API, and traces sent
to an OTLP collector that this test runs. Strangers get nothing; one request is one trace
across all three services."""

from __future__ import annotations

import ssl
import threading
import time
from concurrent import futures

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as otlp
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as otlp_grpc

from baton.v1 import generation_pb2 as gen
from baton.v1 import generation_pb2_grpc as gen_grpc
from baton.worker.v1 import worker_pb2 as wk
from baton.worker.v1 import worker_pb2_grpc as wk_grpc
from tests.e2e.certs import CA
from tests.e2e.helpers import greedy, joined, metric_value
from tests.e2e.topology import Topology

KEY = "s3cret-key"


class Collector(otlp_grpc.TraceServiceServicer):
    """An OTLP trace collector: every span it is sent, as (trace id, service, name)."""

    def __init__(self):
        self.spans: list[tuple[str, str, str]] = []
        self.lock = threading.Lock()

    def Export(self, request, context):
        with self.lock:
            for rs in request.resource_spans:
                service = next((a.value.string_value for a in rs.resource.attributes
                                if a.key == "service.name"), "")
                for ss in rs.scope_spans:
                    for span in ss.spans:
                        self.spans.append((span.trace_id.hex(), service, span.name))
        return otlp.ExportTraceServiceResponse()


@pytest.fixture(scope="module")
def secure(tmp_path_factory, tiny_model):
    folder = tmp_path_factory.mktemp("secure")
    ca, rogue_ca = CA(folder, "baton-ca"), CA(folder, "rogue-ca")
    collector = Collector()
    otlp_server = grpc.server(futures.ThreadPoolExecutor(4))
    otlp_grpc.add_TraceServiceServicer_to_server(collector, otlp_server)
    otlp_port = otlp_server.add_insecure_port("127.0.0.1:0")
    otlp_server.start()
    trace = ("--otlp-traces-endpoint", f"127.0.0.1:{otlp_port}", "--otlp-insecure")
    # Spans exported every 0.1 s; no cluster token: the certificates alone say who is who.
    env = {"OTEL_BSP_SCHEDULE_DELAY": "100", "BATON_CLUSTER_TOKEN": ""}
    topo = Topology(folder, tiny_model)
    try:
        def tls(name: str, authority: CA = ca) -> tuple[str, ...]:
            cert, key = authority.issue(name)
            return "--tls-cert", str(cert), "--tls-key", str(key), "--tls-ca", str(ca.path)

        client_cert, client_key = ca.issue("tester")
        mutual = grpc.ssl_channel_credentials(ca.path.read_bytes(), client_key.read_bytes(),
                                              client_cert.read_bytes())
        public = grpc.ssl_channel_credentials(ca.path.read_bytes())
        p = topo.worker("prefill", "--kv-transport", "nixl", *tls("prefill"), *trace,
                        wait=False, credentials=mutual, env=env)
        d = topo.worker("decode", "--kv-transport", "nixl", *tls("decode"), *trace,
                        wait=False, credentials=mutual, env=env)
        topo.wait()
        router = topo.start("router", "--prefill", p, "--decode", d, *tls("router"),
                            "--api-key", KEY, *trace, credentials=public, env=env)
        yield {"topology": topo, "p": p, "d": d, "router": router, "ca": ca,
               "rogue_ca": rogue_ca, "mutual": mutual, "public": public,
               "collector": collector, "http": "https://" + topo.http[router],
               "tls": tls, "client": (client_cert, client_key)}
    finally:
        topo.stop()
        otlp_server.stop(0)


def _generate(secure, metadata=()):
    with grpc.secure_channel(secure["router"], secure["public"]) as ch:
        req = gen.GenerateRequest(text="Name a colour.", sampling=greedy(8))
        return list(gen_grpc.GenerationStub(ch).Generate(req, metadata=metadata, timeout=60))


def test_without_a_key_nothing_is_served_and_nothing_queued(secure):
    before = _stats(secure, secure["p"]).prefix_cache_queries
    with pytest.raises(grpc.RpcError) as e:
        _generate(secure)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as e:
        _generate(secure, (("authorization", "Bearer wrong"),))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with httpx.Client(verify=ssl.create_default_context(cafile=secure["ca"].path),
                      timeout=30) as http:
        body = {"model": "x", "prompt": "hi"}
        r = http.post(secure["http"] + "/v1/completions", json=body)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert http.get(secure["http"] + "/health").status_code == 200  # open
        assert http.get(secure["http"] + "/metrics").status_code == 200  # open
    assert _stats(secure, secure["p"]).prefix_cache_queries == before
    msgs = _generate(secure, (("authorization", f"Bearer {KEY}"),))
    assert joined(msgs)[1]


def _stats(secure, address: str) -> wk.GetStatsResponse:
    with grpc.secure_channel(address, secure["mutual"]) as ch:
        return wk_grpc.WorkerServiceStub(ch).GetStats(wk.GetStatsRequest(), timeout=10)


def test_a_worker_refuses_a_caller_without_a_certificate_from_its_ca(secure):
    rogue_cert, rogue_key = secure["rogue_ca"].issue("intruder")
    callers = {
        "plaintext": grpc.insecure_channel(secure["p"]),
        "no certificate": grpc.secure_channel(
            secure["p"], grpc.ssl_channel_credentials(secure["ca"].path.read_bytes())),
        "another CA's certificate": grpc.secure_channel(secure["p"], grpc.ssl_channel_credentials(
            secure["ca"].path.read_bytes(), rogue_key.read_bytes(), rogue_cert.read_bytes())),
    }
    for why, channel in callers.items():
        with channel:
            with pytest.raises(grpc.RpcError) as e:
                wk_grpc.WorkerServiceStub(channel).GetStats(wk.GetStatsRequest(), timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE, why
    assert _stats(secure, secure["p"]).engine_id  # with our CA's certificate: served


def test_a_worker_without_the_cas_certificate_cannot_join(secure):
    """A decode worker whose certificate another CA signed: the router cannot reach it
    (it does not trust that certificate), so it never serves through it."""
    topo = secure["topology"]
    rogue = topo.worker("decode", "--kv-transport", "nixl",
                        *secure["tls"]("rogue-decode", secure["rogue_ca"]),
                        healthy=False)
    cert, key = secure["client"]  # the rogue trusts our CA, but itself shows another's
    from baton.services.rpc.processes import is_serving

    seen = grpc.ssl_channel_credentials(secure["rogue_ca"].path.read_bytes(),
                                        key.read_bytes(), cert.read_bytes())
    deadline = time.monotonic() + 120
    while not is_serving(rogue, credentials=seen):  # it loads its model meanwhile
        assert time.monotonic() < deadline
        time.sleep(0.2)
    # Started once the rogue serves, so every poll of the router's reaches it, and each
    # is refused: until its gauge says the first one was (down, not unknown).
    router = topo.start("router", "--prefill", secure["p"], "--decode", rogue,
                        *secure["tls"]("router-2"), healthy=False)
    https = ssl.create_default_context(cafile=secure["ca"].path)
    while _decode_down(f"https://{topo.http[router]}/metrics", https) != 1:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    with grpc.secure_channel(router, secure["public"]) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                     timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as e:
            list(gen_grpc.GenerationStub(ch).Generate(
                gen.GenerateRequest(text="hi", sampling=greedy(2)), timeout=10))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def _decode_down(metrics: str, verify) -> float:
    """A router's count of decode workers down (0 while it cannot be asked)."""
    try:
        text = httpx.get(metrics, verify=verify, timeout=10).text
    except httpx.TransportError:  # not listening yet
        return 0
    return metric_value(text, "baton:workers", role="decode", state="down")


def test_one_trace_spans_router_prefill_and_decode(secure):
    _generate(secure, (("authorization", f"Bearer {KEY}"),))
    want = {("baton-router", "generate"), ("baton-router", "prefill"),
            ("baton-router", "decode"), ("baton-prefill", "queue"),
            ("baton-prefill", "prefill"), ("baton-decode", "kv_pull"),
            ("baton-decode", "decode")}
    collector = secure["collector"]
    deadline = time.monotonic() + 60
    while True:  # spans arrive as each service exports them
        with collector.lock:
            by_trace: dict[str, set[tuple[str, str]]] = {}
            for trace_id, service, name in collector.spans:
                by_trace.setdefault(trace_id, set()).add((service, name))
        if any(want <= spans for spans in by_trace.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert any(want <= spans for spans in by_trace.values()), by_trace


def test_https_with_the_key_serves_the_openai_api(secure):
    with httpx.Client(verify=ssl.create_default_context(cafile=secure["ca"].path), timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as http:
        [model] = http.get(secure["http"] + "/v1/models").json()["data"]
        r = http.post(secure["http"] + "/v1/completions",
                      json={"model": model["id"], "prompt": "Name a colour.",
                            "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
    want = joined(_generate(secure, (("authorization", f"Bearer {KEY}"),)))[1]
    assert r.json()["choices"][0]["text"] == want


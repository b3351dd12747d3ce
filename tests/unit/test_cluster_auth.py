"""Nothing internal is open by default. A prefill or decode worker listens on loopback
unless told otherwise, and one that listens beyond it with neither a cluster token nor
mutual TLS refuses to start (`--insecure-no-cluster-auth` aside). The colocated role's
public port serves no worker RPC, whatever API key the caller holds: only its router
calls its worker, in-process."""

from __future__ import annotations

import logging

import grpc
import pytest

from baton.cli import colocated
from baton.cli.main import main
from baton.services.rpc.config import ServiceConfig
from baton.services.worker.config import WorkerConfig
from baton.services.worker.runtime import run_worker
from baton.worker.v1 import worker_pb2 as wk
from tests.e2e.certs import CA

TOKEN = "c" * 32
KEY = "a-valid-api-key"
WORKER_SERVICES = ("PrefillService", "DecodeService", "WorkerService")


# ---- workers: loopback by default; beyond it, only with a way to check callers ----------

@pytest.fixture
def started(monkeypatch):
    """The worker configs `baton serve` would run (nothing runs), with no BATON_* address,
    token or TLS from the environment."""
    from baton.decode_worker import server as decode_server
    from baton.prefill_worker import server as prefill_server

    for name in ("BATON_ADDRESS", "BATON_HOST", "BATON_CLUSTER_TOKEN",
                 "BATON_CLUSTER_TOKEN_FILE", "BATON_TLS_CA", "BATON_TLS_CERT",
                 "BATON_TLS_KEY", "BATON_INSECURE_NO_CLUSTER_AUTH"):
        monkeypatch.delenv(name, raising=False)
    configs: list[WorkerConfig] = []
    monkeypatch.setattr(prefill_server, "serve", configs.append)
    monkeypatch.setattr(decode_server, "serve", configs.append)
    return configs


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "cluster-token"
    path.write_text(TOKEN + "\n")
    return str(path)


def _serve(role: str, *flags: str) -> None:
    main(["serve", "--role", role, "--kv-transport", "grpc", *flags])


@pytest.mark.parametrize("role, port", [("prefill", 50061), ("decode", 50071)])
def test_a_worker_listens_on_loopback_unless_told(started, token_file, role, port):
    _serve(role)
    assert started[-1].service.address == f"127.0.0.1:{port}"
    _serve(role, "--host", "10.1.2.3", "--cluster-token-file", token_file)
    assert started[-1].service.address == f"10.1.2.3:{port}"
    assert WorkerConfig().service.local_only and ServiceConfig().local_only


@pytest.mark.parametrize("role", ["prefill", "decode"])
@pytest.mark.parametrize("where", [("--address", "0.0.0.0:50061"), ("--host", "::"),
                                   ("--host", "10.1.2.3"), ("--host", "worker-1.internal")])
def test_a_worker_beyond_loopback_with_nothing_to_check_callers_refuses_to_start(
        started, role, where):
    with pytest.raises(SystemExit) as e:
        _serve(role, *where)
    assert "neither a cluster token nor mutual TLS" in str(e.value)
    assert "--insecure-no-cluster-auth" in str(e.value)
    assert not started  # refused before anything loads or listens


def test_a_worker_beyond_loopback_starts_with_a_token_mutual_tls_or_the_insecure_flag(
        started, token_file, tmp_path, monkeypatch, caplog):
    beyond = ("--address", "0.0.0.0:50071")
    _serve("decode", *beyond, "--cluster-token-file", token_file)
    monkeypatch.setenv("BATON_CLUSTER_TOKEN", TOKEN)
    _serve("prefill", *beyond)
    monkeypatch.delenv("BATON_CLUSTER_TOKEN")
    ca = CA(tmp_path, "ca")
    cert, key = ca.issue("worker")
    _serve("decode", *beyond, "--tls-ca", str(ca.path), "--tls-cert", str(cert),
           "--tls-key", str(key))
    assert len(started) == 3
    with caplog.at_level(logging.WARNING):
        _serve("decode", *beyond, "--insecure-no-cluster-auth")
    assert started[-1].insecure_no_cluster_auth
    assert any("neither a cluster token" in r.getMessage() for r in caplog.records
               if r.levelno == logging.WARNING)  # it starts, and says so


def test_a_worker_started_without_the_cli_refuses_too():
    open_config = WorkerConfig(service=ServiceConfig("0.0.0.0:50061"))
    with pytest.raises(ValueError, match="insecure-no-cluster-auth"):
        run_worker(open_config, "prefill", None, "PrefillService", None)  # before any use
    for fine in (ServiceConfig("unix:/tmp/baton-worker.sock"), ServiceConfig("[::1]:1"),
                 ServiceConfig("localhost:1"), ServiceConfig("0.0.0.0:1", cluster_token=TOKEN)):
        WorkerConfig(service=fine).check_cluster_auth()
    WorkerConfig(service=ServiceConfig("0.0.0.0:1"),
                 insecure_no_cluster_auth=True).check_cluster_auth()


def test_the_colocated_role_is_not_refused_it_has_no_cluster(monkeypatch, started):
    runs = []
    monkeypatch.setattr(colocated, "serve", lambda worker, router: runs.append(worker))
    main(["serve", "--role", "colocated", "--address", "0.0.0.0:50051", "--api-key", KEY])
    assert len(runs) == 1


# ---- colocated: the public port serves no worker RPC ------------------------------------

def _worker_methods() -> list[tuple[str, bool]]:
    """(full method name, server-streaming) of every RPC of worker.proto's services."""
    return [(f"/{wk.DESCRIPTOR.services_by_name[s].full_name}/{m.name}", m.server_streaming)
            for s in WORKER_SERVICES for m in wk.DESCRIPTOR.services_by_name[s].methods]


async def _answer(channel: grpc.aio.Channel, method: str, streaming: bool, request: bytes):
    """The status a call of `method` with a valid API key ends with."""
    identity = bytes  # raw bytes out and in: every method without its stub
    make = channel.unary_stream if streaming else channel.unary_unary
    call = make(method, request_serializer=identity, response_deserializer=identity)
    try:
        if streaming:
            async for _ in call(request, metadata=(("authorization", f"Bearer {KEY}"),),
                                timeout=10):
                pass
        else:
            await call(request, metadata=(("authorization", f"Bearer {KEY}"),), timeout=10)
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK




def test_ranks_over_several_hosts_need_the_cluster_token_which_reaches_the_engine():
    from baton.services.engine.config import EngineConfig
    from baton.services.engine.tp_ranks import rendezvous

    over_two = {"tensor_parallel_size": 2, "nnodes": 2,
                "distributed_init_address": "127.0.0.1:1"}
    with pytest.raises(ValueError, match="insecure-no-cluster-auth"):
        rendezvous(EngineConfig(**over_two))
    # The worker's token and opt-out are the engine's too (the CLI fills only the worker's).
    worker = WorkerConfig(service=ServiceConfig("127.0.0.1:1", cluster_token=TOKEN))
    assert worker.engine.cluster_token == TOKEN and TOKEN not in repr(worker.engine)
    assert WorkerConfig(insecure_no_cluster_auth=True).engine.insecure_no_cluster_auth
    assert rendezvous(EngineConfig(**over_two, cluster_token=TOKEN)).secret
    assert not rendezvous(EngineConfig(**over_two, insecure_no_cluster_auth=True)).secret

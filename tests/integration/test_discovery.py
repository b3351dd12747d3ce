"""Workers found by DNS: addresses parsed, names resolved (the system's resolver and a
test DNS server), and a registry that follows the records as workers come and go."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from baton.router import registry as registry_module
from baton.router.clients import GrpcWorkerClient, WorkerError
from baton.router.config import RouterConfig
from baton.router.discovery import Target, resolve
from baton.router.registry import Registry
from baton.router.reply import Caller
from baton.router.server import build
from baton.services.rpc.server import Lifecycle
from baton.v1 import generation_pb2 as gen
from baton.worker.v1 import worker_pb2 as wk
from tests.dns_server import DnsServer
from tests.router_fakes import FAKES, FakeWorker, _serve, expected, request


@pytest.fixture
def dns_server():
    server = DnsServer()
    yield server
    server.close()


def test_targets_parse_or_say_what_is_wrong():
    assert Target.parse("decode:50071") == Target("decode:50071", "decode", 50071)
    t = Target.parse("dns:///decode.baton.svc.cluster.local:50071")
    assert (t.dns, t.host, t.port, t.server) == (True, "decode.baton.svc.cluster.local",
                                                  50071, None)
    t = Target.parse("dns://10.0.0.10/decode:50071")
    assert t.server == ("10.0.0.10", 53)
    assert Target.parse("[::1]:7").host == "::1"
    for bad in ("decode", "dns:decode:1", "dns:///decode", "host:99999", "dns://x:y/a:1"):
        with pytest.raises(ValueError):
            Target.parse(bad)
    with pytest.raises(ValueError, match="--decode"):
        RouterConfig(decode=("dns:///nope",))
    with pytest.raises(ValueError, match="IP address"):  # dnspython asks IPs only
        Target.parse("dns://kube-dns/decode:50071")


def test_names_resolve_through_the_system_and_through_a_given_server(dns_server):
    async def main():
        local = await resolve(Target.parse("dns:///localhost:81"))
        assert "127.0.0.1:81" in local
        dns_server.set("decode.test", ["127.0.0.3", "127.0.0.2"])
        at = f"dns://127.0.0.1:{dns_server.port}/"
        assert await resolve(Target.parse(at + "decode.test:9")) == ["127.0.0.2:9",
                                                                     "127.0.0.3:9"]
        assert await resolve(Target.parse(at + "missing.test:9")) == []  # NXDOMAIN
        dns_server.set("dual.test", ["127.0.0.5", "::1"])  # one dual-stack pod
        assert await resolve(Target.parse(at + "dual.test:9")) == ["127.0.0.5:9"]
        dns_server.set("v6.test", ["::1"])
        assert await resolve(Target.parse(at + "v6.test:9")) == ["[::1]:9"]
        assert await resolve(Target.parse("[::1]:7")) == ["[::1]:7"]  # fixed: as given
        with pytest.raises(OSError):  # nobody answers: the caller keeps what it knew
            await resolve(Target.parse("dns://127.0.0.1:9/decode.test:9"), timeout=0.3)
    asyncio.run(main())


def test_the_router_follows_the_records_and_no_request_fails(tok, dns_server):
    """Three decode workers behind one name; one dies and leaves the records, another
    joins: the router follows within seconds, every request completes."""
    async def main():
        FAKES.clear()
        workers, servers = {}, {}

        async def start(host: str, port: int) -> int:
            w = FakeWorker("decode", f"d-{host}", token_delay_s=0.01)
            servers[host] = await _serve(w, host, port)
            workers[host] = w
            FAKES[w.engine_id] = w
            return int(w.address.rsplit(":", 1)[1])

        port = await start("127.0.0.1", 0)
        for host in ("127.0.0.2", "127.0.0.3"):
            await start(host, port)
        dns_server.set("decode.test", ["127.0.0.1", "127.0.0.2", "127.0.0.3"])
        config = RouterConfig(
            decode=(f"dns://127.0.0.1:{dns_server.port}/decode.test:{port}",),
            model=str(tok), http_port=0, poll_interval=0.05, worker_timeout=0.5,
            discovery_interval=0.2)
        router = build(config, Lifecycle(), targets={"decode": config.targets("decode")},
                       make_client=GrpcWorkerClient)
        await router.registry.start()
        failures, done = [], 0

        async def client(i: int) -> None:
            nonlocal done
            while not stop.is_set():
                prompt = [i, done % 97 + 1, 5]
                try:
                    out = [t async for r in router.generate(request(prompt, 12), Caller())
                           for t in r.delta.token_ids]
                    assert out == expected(prompt, 12), "a gap or a repeat"
                    done += 1
                except Exception as e:  # noqa: BLE001 - every failure is the finding
                    failures.append(repr(e))

        def addresses() -> set[str]:
            return {w.address for w in router.registry.decode}

        async def until(check, what: str) -> None:
            deadline = time.monotonic() + 60
            while not check():
                assert time.monotonic() < deadline and not failures, (what, failures)
                await asyncio.sleep(0.05)

        stop = asyncio.Event()
        clients = [asyncio.create_task(client(i)) for i in range(4)]
        await until(lambda: all(w.decodes for w in workers.values()), "all three serve")
        await servers["127.0.0.2"].stop(0)  # killed: its streams break mid-way
        await start("127.0.0.4", port)
        dns_server.set("decode.test", ["127.0.0.1", "127.0.0.3", "127.0.0.4"])
        await until(lambda: addresses() == {f"127.0.0.{i}:{port}" for i in (1, 3, 4)},
                    "the router follows the records")
        before, served = len(workers["127.0.0.4"].decodes), done
        # The newcomer serves, and requests go on completing for a while.
        await until(lambda: len(workers["127.0.0.4"].decodes) > before + 4
                    and done > served + 20, "the newcomer serves")
        stop.set()
        await asyncio.gather(*clients)
        assert failures == []
        assert router.registry.retired == []  # the dead one's channel is closed
        await router.registry.close()
        router.intake.close()
        for s in servers.values():
            await s.stop(0)
    asyncio.run(main())


def test_a_name_that_cannot_be_resolved_keeps_the_other_targets_workers(tok):
    async def main():
        config = RouterConfig(decode=("127.0.0.1:1", "dns://127.0.0.1:9/decode.test:2"),
                              model=str(tok), http_port=0)
        router = build(config, Lifecycle(), targets={"decode": config.targets("decode")},
                       make_client=GrpcWorkerClient)
        await router.registry.discover()  # nobody answers DNS on port 9
        assert [w.address for w in router.registry.decode] == ["127.0.0.1:1"]
        await router.registry.close()
        router.intake.close()
    asyncio.run(main())


class _Client:
    """What discovery asks of a worker's client."""

    def __init__(self, address: str):
        self.address = address

    def busy(self) -> bool:
        return False

    async def close(self) -> None:
        pass


class _Clock:
    """The registry's `time`, moved by hand: a grace is counted on it, not waited out."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    ctime = staticmethod(time.ctime)


def test_a_name_that_answers_none_keeps_its_workers_for_the_grace(dns_server, monkeypatch):
    """One NXDOMAIN or empty answer must not retire every worker at once: the last good
    set stays for the grace (an answer with records meanwhile starts it over), then
    they retire."""
    grace = 10.0
    clock = _Clock()
    monkeypatch.setattr(registry_module, "time", clock)

    async def main():
        target = Target.parse(f"dns://127.0.0.1:{dns_server.port}/decode.test:9")
        registry = Registry([], [], targets={"decode": [target]}, make_client=_Client,
                            discovery_grace=grace)
        both = ["127.0.0.1:9", "127.0.0.2:9"]

        def addresses() -> list[str]:
            return sorted(w.address for w in registry.decode)

        async def at(t: float) -> list[str]:
            """The workers known after a lookup at `t` seconds."""
            clock.now = 1000.0 + t
            await registry.discover()
            return addresses()

        dns_server.set("decode.test", ["127.0.0.1", "127.0.0.2"])
        assert await at(0) == both
        dns_server.records.pop("decode.test")  # NXDOMAIN
        assert await at(1) == both and registry.retired == []
        assert await at(1 + 0.9 * grace) == both
        dns_server.set("decode.test", ["127.0.0.1", "127.0.0.2"])  # back: start over
        assert await at(1 + 0.95 * grace) == both
        dns_server.set("decode.test", [])  # the name, with no records
        empty = 1 + 1.5 * grace  # past the grace of the first NXDOMAIN, had it stayed
        assert await at(empty) == both
        assert await at(empty + 0.99 * grace) == both
        assert await at(empty + grace) == []
        await registry.close()

    asyncio.run(main())


def test_a_grace_of_zero_retires_at_the_first_empty_answer(dns_server):
    async def main():
        target = Target.parse(f"dns://127.0.0.1:{dns_server.port}/decode.test:9")
        registry = Registry([], [], targets={"decode": [target]}, make_client=_Client,
                            discovery_grace=0)
        dns_server.set("decode.test", ["127.0.0.1"])
        await registry.discover()
        dns_server.set("decode.test", [])
        await registry.discover()
        assert registry.decode == []
        await registry.close()

    asyncio.run(main())


def test_a_stream_failed_between_two_reads_counts_as_its_worker_down():
    """fail_inflight() (the registry's word that a worker is gone) may land while the
    router is busy between two messages of a stream: gRPC's next read then says CANCELLED,
    which must move the stream on as the read that was waiting does, never end it."""
    async def main():
        worker = FakeWorker("decode", "d-slow", token_delay_s=0.01)
        server = await _serve(worker)
        client = GrpcWorkerClient(worker.address)
        try:
            stream = client.decode(wk.DecodeRequest(
                request_id="r", prompt_token_ids=[1, 2, 3],
                sampling=gen.SamplingParams(max_tokens=50)), timeout=10)
            assert (await anext(stream)).delta.token_ids
            client.fail_inflight()  # between two reads: no read is waiting
            await asyncio.sleep(0.05)
            with pytest.raises(WorkerError) as err:
                async for _ in stream:
                    pass
            assert err.value.worker_down, err.value
        finally:
            await client.close()
            await server.stop(0)
    asyncio.run(main())


def test_a_call_failed_by_the_registry_that_ends_cancelled_is_its_worker_down():
    # Seen under load: a stream the registry failed ended with gRPC's own CANCELLED
    # ("Locally cancelled by application!"), not asyncio's CancelledError, and reached
    # the client as an error instead of moving on.
    async def main():
        client = GrpcWorkerClient("127.0.0.1:1")
        call = object()
        cancelled = grpc.aio.AioRpcError(grpc.StatusCode.CANCELLED, grpc.aio.Metadata(),
                                         grpc.aio.Metadata(),
                                         details="Locally cancelled by application!")
        with pytest.raises(WorkerError) as err:
            with client._tracked(call):
                client._inflight[call] = True  # what fail_inflight() marks
                raise cancelled
        assert err.value.worker_down
        with pytest.raises(WorkerError) as err:  # not failed by the registry: as it says
            with client._tracked(call):
                raise cancelled
        assert err.value.code == grpc.StatusCode.CANCELLED
        await client.close()
    asyncio.run(main())

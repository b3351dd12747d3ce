"""A prefill worker's answer carries a KV lease: one that never reaches the router must
not hold the blocks until the lease expires. The router's AbortPrefill covers an answer
lost after the grant; an answer whose call ends past its deadline is the worker's own to
end, since the router's abort may have come before the grant (gRPC then drops the answer,
or it reaches a router past its own deadline, and the call does not read as cancelled).
An abort that lands before the grant, while the call still has time left on the worker,
ends the lease as it is granted."""

from __future__ import annotations

import asyncio
import contextlib
import time
from types import SimpleNamespace

import grpc

from baton.prefill_worker.server import PrefillServicer
from baton.services.engine.outputs import RequestOutput
from baton.services.rpc.server import Lifecycle, make_server, service_name
from baton.worker.v1 import worker_pb2 as wk
from baton.worker.v1 import worker_pb2_grpc as wk_grpc
from tests.integration.test_cluster_token import LAYOUT

LEASE = 42


class GrantingEngine:
    """What PrefillServicer touches of an AsyncEngine: each prompt is granted a lease at
    once, or (`late`) with the event loop held past the call's deadline, so the answer
    goes out after it with no await in between (as when the grant and the deadline land
    together on a busy worker). Records the leases released."""

    def __init__(self, late: bool):
        self.late = late
        self.context = None  # the Prefill call's (Servicer sets it)
        self.released: list[tuple[str, int | None]] = []
        self.engine = SimpleNamespace(kv_layout=LAYOUT, sampling_defaults=None,
                                      config=SimpleNamespace(kv_lease_timeout_s=30.0))

    async def compile(self, params):
        return None

    async def generate(self, request_id, add):
        while self.late and self.context.time_remaining() > 0:
            time.sleep(0.01)  # the loop held until the deadline has passed
        yield RequestOutput(request_id, [1, 2, 3], [7], "x", new_token_ids=[7],
                            kv_block_ids=[1], kv_lease_id=LEASE)

    def release_lease(self, request_id: str, lease_id: int | None = None) -> bool:
        self.released.append((request_id, lease_id))
        return True


class Servicer(PrefillServicer):
    async def Prefill(self, request, context):
        self.aengine.context = context
        return await super().Prefill(request, context)


@contextlib.asynccontextmanager
async def served(servicer):
    """`servicer` served on a loopback port: yields a PrefillService stub; on leaving,
    the server stops once every call has ended and its callbacks have run."""

    def register(server):
        wk_grpc.add_PrefillServiceServicer_to_server(servicer, server)
        return [service_name(wk, "PrefillService")]

    server = make_server(register, Lifecycle())
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield wk_grpc.PrefillServiceStub(channel)
    finally:
        await server.stop(None)


async def status(call) -> grpc.StatusCode:
    """The status a unary call ends with."""
    try:
        await call
        return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as e:
        return e.code()


async def _prefill(late: bool) -> tuple[grpc.StatusCode, list]:
    """One Prefill call with a deadline (a second for the late grant to pass; far more
    than the call takes, for the one in time): its status, and the leases released."""
    aengine = GrantingEngine(late)
    servicer = Servicer(aengine, "prefill-1", "fake", b"", SimpleNamespace(
        observe=lambda out: None))

    async with served(servicer) as stub:
        code = await status(stub.Prefill(
            wk.PrefillRequest(request_id="r1", prompt_token_ids=[1, 2, 3]),
            timeout=1.0 if late else 60.0))
        deadline = time.monotonic() + 30  # the call's end reaches the worker's callback
        while late and not aengine.released and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
    return code, aengine.released


def test_an_answer_past_its_deadline_ends_its_lease_on_the_worker():
    """Sent past the deadline, the answer is dropped, or (gRPC's timers racing) reaches
    a caller whose own deadline has passed too: either way the lease is ended here (a
    handle that arrived all the same fails the decode worker's lease check)."""
    code, released = asyncio.run(_prefill(late=True))
    assert code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.OK)
    assert released == [("r1", LEASE)]


def test_an_answer_in_time_leaves_its_lease_to_the_decode_worker():
    code, released = asyncio.run(_prefill(late=False))
    assert code == grpc.StatusCode.OK and released == []


class GatedEngine(GrantingEngine):
    """Grants the lease only once `gate` opens, and keeps a lease table: a release ends
    the lease only if it is held (as services/engine/leases.py does)."""

    def __init__(self):
        super().__init__(late=False)
        self.entered, self.gate = asyncio.Event(), asyncio.Event()
        self.held: set[tuple[str, int]] = set()

    async def generate(self, request_id, add):
        self.entered.set()
        await self.gate.wait()
        self.held.add((request_id, LEASE))
        yield RequestOutput(request_id, [1, 2, 3], [7], "x", new_token_ids=[7],
                            kv_block_ids=[1], kv_lease_id=LEASE)

    def release_lease(self, request_id: str, lease_id: int | None = None) -> bool:
        for rid, lease in list(self.held):
            if rid == request_id and lease_id in (None, lease):
                self.held.discard((rid, lease))
                return True
        return False


def test_an_abort_before_the_grant_ends_the_lease_once_granted():
    """The router's deadline passes before the worker's (which starts when the call
    arrives), so its AbortPrefill can land while the prompt still runs and the call has
    time left: the lease granted after it must end at once, not wait 30 s to expire."""

    async def run():
        aengine = GatedEngine()
        servicer = PrefillServicer(aengine, "prefill-1", "fake", b"",
                                   SimpleNamespace(observe=lambda out: None))

        async with served(servicer) as stub:
            call = asyncio.ensure_future(stub.Prefill(
                wk.PrefillRequest(request_id="r1", prompt_token_ids=[1, 2, 3]),
                timeout=60.0))
            await asyncio.wait_for(aengine.entered.wait(), 30)
            aborted = await stub.AbortPrefill(wk.AbortPrefillRequest(request_id="r1"))
            aengine.gate.set()
            code = await status(call)
        return aborted.released, code, aengine.held

    released_by_abort, code, held = asyncio.run(run())
    assert released_by_abort is False  # nothing granted yet when it came
    assert code == grpc.StatusCode.ABORTED
    assert held == set()


def test_an_abort_that_overtakes_its_call_refuses_the_call():
    """On a loaded machine the router's AbortPrefill can land before the Prefill call it
    ends: that call, when it comes, is refused, and no prompt reaches the engine (whose
    lease would go to nobody)."""

    async def run():
        aengine = GatedEngine()
        aengine.gate.set()
        servicer = PrefillServicer(aengine, "prefill-1", "fake", b"",
                                   SimpleNamespace(observe=lambda out: None))

        async with served(servicer) as stub:
            await stub.AbortPrefill(wk.AbortPrefillRequest(request_id="r1"))
            codes = [await status(stub.Prefill(wk.PrefillRequest(
                request_id=rid, prompt_token_ids=[1, 2, 3]), timeout=60.0))
                for rid in ("r1", "r2")]  # the one given up, then another
        return codes, aengine.held

    codes, held = asyncio.run(run())
    assert codes == [grpc.StatusCode.ABORTED, grpc.StatusCode.OK]
    assert held == {("r2", LEASE)}  # r1 never reached the engine; r2's lease is r2's

"""How the router calls one worker: over gRPC (GrpcWorkerClient), or in the same process
(LocalWorkerClient, the colocated server). Both raise WorkerError for a failed call, so
the router's logic is the same either way.

A worker that stops answering (frozen, or dead without closing its connections) is
noticed by the registry's stats polls, which then call `fail_inflight()`: every call in
flight to that worker ends with WorkerError(UNAVAILABLE), and the router moves those
requests on, as if the worker had died.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing, contextmanager

import grpc

from baton.services.common.capacity import AtCapacity
from baton.services.common.errors import NotFound
from baton.services.rpc.errors import BY_CODE, ServiceError, retry_after_s
from baton.services.rpc.security import Security
from baton.services.rpc.server import CHANNEL_OPTIONS, status_of
from baton.worker.v1 import worker_pb2 as wk
from baton.worker.v1 import worker_pb2_grpc as wk_grpc

# What a worker that failed (died, froze, or whose engine failed) looks like: the request
# goes to another worker. A deliberate refusal (ABORTED, INVALID_ARGUMENT, ...) does not.
WORKER_DOWN = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}


class WorkerError(Exception):
    def __init__(self, code: grpc.StatusCode, details: str, retry_after: float | None = None):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.retry_after_s = retry_after

    @property
    def worker_down(self) -> bool:
        return self.code in WORKER_DOWN

    def as_service_error(self, where: str) -> ServiceError:
        """The error to give the client: the worker's code for what the client caused
        (bad input, overload with its retry hint, its deadline), else UNAVAILABLE."""
        cls = BY_CODE.get(self.code)
        if cls is None or self.code in WORKER_DOWN or self.code == grpc.StatusCode.ABORTED:
            cls = BY_CODE[grpc.StatusCode.UNAVAILABLE]
        err = cls.__new__(cls)
        ServiceError.__init__(err, f"{where}: {self.details}", self.retry_after_s)
        return err


class GrpcWorkerClient:
    def __init__(self, address: str, security: Security | None = None):
        self.address = address
        self.channel = (security.aio_channel(address) if security is not None
                        else grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS))
        self._inflight: dict[grpc.aio.Call, bool] = {}  # call -> failed by fail_inflight()
        self._closed = False

    async def close(self) -> None:
        self._closed = True
        await self.channel.close()

    @property
    def retired(self) -> bool:
        """Closed: the worker left the registry, and nothing more is sent to it."""
        return self._closed

    def _check_open(self) -> None:
        if self._closed:  # a retired worker: a late release, or a pick made before
            raise WorkerError(grpc.StatusCode.UNAVAILABLE, f"worker {self.address} retired")

    def busy(self) -> bool:
        """Calls are in flight (a retired worker's channel stays open until none is)."""
        return bool(self._inflight)

    def fail_inflight(self) -> None:
        for call in list(self._inflight):
            self._inflight[call] = True
            call.cancel()

    def _error(self, call, e: BaseException) -> WorkerError | None:
        """The WorkerError for a call that ended with `e`, or None to re-raise `e`."""
        task = asyncio.current_task()
        # Ended by fail_inflight: the awaiting read sees CancelledError, or, where the
        # cancel came between two reads, the next one sees gRPC's own CANCELLED.
        failed = self._inflight.get(call) and (
            isinstance(e, asyncio.CancelledError) and not (task and task.cancelling())
            or isinstance(e, grpc.aio.AioRpcError) and e.code() == grpc.StatusCode.CANCELLED)
        if failed:
            return WorkerError(grpc.StatusCode.UNAVAILABLE,
                               f"worker {self.address} stopped answering")
        if isinstance(e, grpc.aio.AioRpcError):
            return WorkerError(e.code(), e.details() or "", retry_after_s(e.trailing_metadata()))
        return None

    @contextmanager
    def _tracked(self, call):
        """A call in flight: fail_inflight() may end it; its failures become WorkerError."""
        self._inflight[call] = False
        try:
            yield
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as e:
            err = self._error(call, e)
            if err is None:
                raise
            raise err from None
        finally:
            self._inflight.pop(call, None)

    async def _unary(self, make_call):
        self._check_open()
        call = make_call()
        with self._tracked(call):
            return await call

    async def prefill(self, req: wk.PrefillRequest, timeout: float, metadata=()
                      ) -> wk.PrefillResponse:
        return await self._unary(lambda: wk_grpc.PrefillServiceStub(self.channel).Prefill(
            req, timeout=timeout, metadata=metadata))

    async def decode(self, req: wk.DecodeRequest, timeout: float, metadata=()
                     ) -> AsyncIterator[wk.DecodeResponse]:
        self._check_open()
        call = wk_grpc.DecodeServiceStub(self.channel).Decode(req, timeout=timeout,
                                                              metadata=metadata)
        try:
            with self._tracked(call):
                async for msg in call:
                    yield msg
        finally:
            call.cancel()  # a no-op when done; else the caller left: end it on the worker

    async def release(self, request_id: str, lease_id: int) -> bool:
        reply = await self._unary(lambda: wk_grpc.PrefillServiceStub(self.channel).ReleaseKv(
            wk.ReleaseKvRequest(request_id=request_id, lease_id=lease_id), timeout=10))
        return reply.released

    async def abort_prefill(self, request_id: str, timeout: float) -> bool:
        reply = await self._unary(lambda: wk_grpc.PrefillServiceStub(self.channel).AbortPrefill(
            wk.AbortPrefillRequest(request_id=request_id), timeout=timeout))
        return reply.released

    async def stats(self, timeout: float) -> wk.GetStatsResponse:
        return await self._unary(lambda: wk_grpc.WorkerServiceStub(self.channel).GetStats(
            wk.GetStatsRequest(), timeout=timeout))

    async def connect(self, prefill_address: str) -> wk.ConnectResponse:
        return await self._unary(lambda: wk_grpc.DecodeServiceStub(self.channel).Connect(
            wk.ConnectRequest(prefill_address=prefill_address), timeout=30))

    async def kv_events(self, engine_id: str, after: int, timeout: float
                        ) -> wk.GetKvEventsResponse:
        return await self._unary(lambda: wk_grpc.WorkerServiceStub(self.channel).GetKvEvents(
            wk.GetKvEventsRequest(engine_id=engine_id, after=after), timeout=timeout))

    async def load_lora(self, name: str, path: str, version: int, timeout: float) -> None:
        adapter = wk.LoraAdapter(name=name, path=path, version=version)
        await self._unary(lambda: wk_grpc.WorkerServiceStub(self.channel).LoadLora(
            wk.LoadLoraRequest(adapter=adapter), timeout=timeout))

    async def unload_lora(self, name: str, timeout: float) -> bool:
        reply = await self._unary(lambda: wk_grpc.WorkerServiceStub(self.channel).UnloadLora(
            wk.UnloadLoraRequest(name=name), timeout=timeout))
        return reply.unloaded


class LocalContext:
    """What an in-process call's handler may ask of its context."""

    def __init__(self, metadata=()):
        self._metadata = tuple(metadata)

    def invocation_metadata(self):
        return self._metadata

    def cancelled(self) -> bool:
        return False


class LocalWorkerClient:
    """A worker in this process: its servicers called directly (no serialization, no
    network). Errors they raise become WorkerErrors, as their status codes would."""

    retired = False

    def __init__(self, address: str, decode_servicer, worker_servicer):
        self.address = address
        self._decode = decode_servicer
        self._worker = worker_servicer

    async def close(self) -> None:
        pass

    def busy(self) -> bool:
        return False

    def fail_inflight(self) -> None:
        pass  # it cannot freeze without freezing us

    @staticmethod
    def _error(e: Exception) -> WorkerError:
        code, details = status_of(e)
        return WorkerError(code, details, getattr(e, "retry_after_s", None))

    async def decode(self, req: wk.DecodeRequest, timeout: float, metadata=()
                     ) -> AsyncIterator[wk.DecodeResponse]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            async with aclosing(self._decode.Decode(req, LocalContext(metadata))) as replies:
                while True:
                    try:
                        msg = await asyncio.wait_for(anext(replies), deadline - loop.time())
                    except StopAsyncIteration:
                        return
                    yield msg
        except TimeoutError:
            raise WorkerError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded") from None
        except (ServiceError, AtCapacity, NotFound, ValueError, TypeError) as e:
            raise self._error(e) from None

    async def load_lora(self, name: str, path: str, version: int, timeout: float) -> None:
        try:
            await self._worker.LoadLora(wk.LoadLoraRequest(
                adapter=wk.LoraAdapter(name=name, path=path, version=version)), None)
        except (ServiceError, AtCapacity, NotFound, ValueError, TypeError) as e:
            raise self._error(e) from None

    async def unload_lora(self, name: str, timeout: float) -> bool:
        try:
            reply = await self._worker.UnloadLora(wk.UnloadLoraRequest(name=name), None)
        except (ServiceError, ValueError, TypeError) as e:
            raise self._error(e) from None
        return reply.unloaded

    async def stats(self, timeout: float) -> wk.GetStatsResponse:
        return await self._worker.GetStats(wk.GetStatsRequest(), None)

    async def prefill(self, req, timeout, metadata=()):  # colocated: no prefill worker
        raise WorkerError(grpc.StatusCode.UNIMPLEMENTED, "no prefill role here")

    async def release(self, request_id: str, lease_id: int) -> bool:
        return False

    async def abort_prefill(self, request_id: str, timeout: float) -> bool:
        return False

    async def kv_events(self, engine_id: str, after: int, timeout: float):
        # Alone in its process, it is the only decode worker: nothing to choose between.
        raise WorkerError(grpc.StatusCode.UNIMPLEMENTED, "one worker: no KV routing")

    async def connect(self, prefill_address: str):
        raise WorkerError(grpc.StatusCode.UNIMPLEMENTED, "no prefill role here")


# What the registry holds for each worker: both answer every call (the local one
# UNIMPLEMENTED for what a colocated worker has no use for).
WorkerClient = GrpcWorkerClient | LocalWorkerClient

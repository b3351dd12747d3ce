"""The asyncio client (grpc.aio): the same surface as Client, awaited."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import grpc

from baton.v1 import generation_pb2 as gen
from baton.v1 import generation_pb2_grpc as gen_grpc
from baton_client.connection import call_metadata, check_timeout, credentials
from baton_client.errors import BatonError
from baton_client.request import generate_request, tokenize_request
from baton_client.results import Chunk, Completion, ModelInfo, chunk_of, model_info_of
from baton_client.retry import RetryPolicy, deadline_of, remaining


class AsyncClient:
    """As Client, on grpc.aio; make it inside a running event loop. `generate` returns an
    async iterator; leaving it early cancels the request once it is closed (at once with
    `contextlib.aclosing`)."""

    def __init__(self, address: str, *, api_key: str | None = None, tls: bool = False,
                 root_certificates: bytes | None = None, timeout: float | None = None,
                 max_retries: int = 3, channel_options: Sequence[tuple] = ()):
        self.timeout = check_timeout(timeout)
        self.retry = RetryPolicy(max_retries=max_retries)
        creds = credentials(tls, root_certificates)
        self._channel = (grpc.aio.secure_channel(address, creds, options=channel_options)
                         if creds else grpc.aio.insecure_channel(address,
                                                                 options=channel_options))
        self._stub = gen_grpc.GenerationStub(self._channel)
        self._metadata = call_metadata(api_key)

    def generate(self, prompt: str | None = None, *, timeout: float | None = None,
                 **options) -> AsyncIterator[Chunk]:
        """Stream a completion as Chunks (see Client.generate)."""
        request = generate_request(prompt, **options)
        return self._stream(request, deadline_of(check_timeout(timeout) or self.timeout))

    async def complete(self, prompt: str | None = None, *, timeout: float | None = None,
                       **options) -> Completion:
        return Completion.of([c async for c in self.generate(prompt, timeout=timeout,
                                                             **options)])

    async def tokenize(self, text: str | None = None, *, messages=None,
                       timeout: float | None = None) -> tuple[int, ...]:
        request = tokenize_request(text, messages=messages)
        return tuple((await self._unary(self._stub.Tokenize, request, timeout)).token_ids)

    async def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        return model_info_of(await self._unary(self._stub.GetModelInfo,
                                               gen.GetModelInfoRequest(), timeout))

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _stream(self, request: gen.GenerateRequest,
                      deadline: float | None) -> AsyncIterator[Chunk]:
        attempt = 0
        while True:
            call = self._stub.Generate(request, timeout=remaining(deadline),
                                       metadata=self._metadata)
            started = False
            try:
                async for msg in call:
                    started = True
                    yield chunk_of(msg)
                return
            except grpc.RpcError as e:
                error = BatonError.of(e)
                delay = None if started else self.retry.delay(error, attempt, deadline)
                if delay is None:
                    raise error from e
            finally:
                call.cancel()
            await asyncio.sleep(delay)
            attempt += 1

    async def _unary(self, method, request, timeout: float | None):
        deadline = deadline_of(check_timeout(timeout) or self.timeout)
        attempt = 0
        while True:
            try:
                return await method(request, timeout=remaining(deadline),
                                    metadata=self._metadata)
            except grpc.RpcError as e:
                error = BatonError.of(e)
                delay = self.retry.delay(error, attempt, deadline)
                if delay is None:
                    raise error from e
            await asyncio.sleep(delay)
            attempt += 1

"""The blocking client."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import grpc

from baton.v1 import generation_pb2 as gen
from baton.v1 import generation_pb2_grpc as gen_grpc
from baton_client.connection import call_metadata, check_timeout, credentials
from baton_client.errors import BatonError
from baton_client.request import generate_request, tokenize_request
from baton_client.results import Chunk, Completion, ModelInfo, chunk_of, model_info_of
from baton_client.retry import RetryPolicy, deadline_of, remaining


class Client:
    """A connection to a Baton router (or colocated server) at `address` ("host:port").

    `api_key` goes as `authorization: Bearer <key>`; `tls` (or `root_certificates`, PEM
    bytes of the CA) makes the channel TLS; `timeout` is every call's default deadline in
    seconds (None: none); `max_retries` bounds retries of RESOURCE_EXHAUSTED and
    UNAVAILABLE (see RetryPolicy); `channel_options` go to the gRPC channel.
    """

    def __init__(self, address: str, *, api_key: str | None = None, tls: bool = False,
                 root_certificates: bytes | None = None, timeout: float | None = None,
                 max_retries: int = 3, channel_options: Sequence[tuple] = ()):
        self.timeout = check_timeout(timeout)
        self.retry = RetryPolicy(max_retries=max_retries)
        creds = credentials(tls, root_certificates)
        self._channel = (grpc.secure_channel(address, creds, options=channel_options)
                         if creds else grpc.insecure_channel(address, options=channel_options))
        self._stub = gen_grpc.GenerationStub(self._channel)
        self._metadata = call_metadata(api_key)

    def generate(self, prompt: str | None = None, *, timeout: float | None = None,
                 **options) -> Iterator[Chunk]:
        """Stream a completion as Chunks. `options` are generate_request's keyword
        arguments (token_ids=, messages=, max_tokens=, temperature=, ...); a bad one raises
        TypeError here. Stopping the iteration early cancels the request."""
        request = generate_request(prompt, **options)
        return self._stream(request, deadline_of(check_timeout(timeout) or self.timeout))

    def complete(self, prompt: str | None = None, *, timeout: float | None = None,
                 **options) -> Completion:
        """The whole completion at once; the same arguments as generate()."""
        return Completion.of(self.generate(prompt, timeout=timeout, **options))

    def tokenize(self, text: str | None = None, *, messages=None,
                 timeout: float | None = None) -> tuple[int, ...]:
        """The server's token ids for `text`, or for chat `messages` with the template."""
        request = tokenize_request(text, messages=messages)
        return tuple(self._unary(self._stub.Tokenize, request, timeout).token_ids)

    def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        return model_info_of(self._unary(self._stub.GetModelInfo, gen.GetModelInfoRequest(),
                                         timeout))

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _stream(self, request: gen.GenerateRequest, deadline: float | None) -> Iterator[Chunk]:
        attempt = 0
        while True:
            call = self._stub.Generate(request, timeout=remaining(deadline),
                                       metadata=self._metadata)
            started = False
            try:
                for msg in call:
                    started = True
                    yield chunk_of(msg)
                return
            except grpc.RpcError as e:
                error = BatonError.of(e)
                delay = None if started else self.retry.delay(error, attempt, deadline)
                if delay is None:
                    raise error from e
            finally:
                call.cancel()  # a no-op once it ended; ends it when the caller stopped early
            time.sleep(delay)
            attempt += 1

    def _unary(self, method, request, timeout: float | None):
        deadline = deadline_of(check_timeout(timeout) or self.timeout)
        attempt = 0
        while True:
            try:
                return method(request, timeout=remaining(deadline), metadata=self._metadata)
            except grpc.RpcError as e:
                error = BatonError.of(e)
                delay = self.retry.delay(error, attempt, deadline)
                if delay is None:
                    raise error from e
            time.sleep(delay)
            attempt += 1

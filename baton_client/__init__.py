"""A Python client for Baton's public gRPC API (`baton.v1.Generation`), needing only
grpcio and protobuf: sync and asyncio, streaming, typed results, deadlines, and the
server's retry hint honoured.

    from baton_client import BatonError, Client

    with Client("localhost:50051", api_key=None, timeout=60) as client:
        for chunk in client.generate("The capital of France is", max_tokens=32,
                                     temperature=0):
            print(chunk.text, end="", flush=True)
        done = client.complete(messages=[{"role": "user", "content": "Hi!"}],
                               max_tokens=64, timeout=30)
        print(done.text, done.finish_reason, done.usage)

    # asyncio: the same calls, awaited
    async with AsyncClient("localhost:50051") as client:
        async for chunk in client.generate("Hello", max_tokens=16):
            ...

Failed calls raise BatonError (`code`, `details`, `retry_after_s`). RESOURCE_EXHAUSTED
and UNAVAILABLE are retried after the server's `retry-after-ms` hint (up to
`max_retries`, never past the deadline), but only before the first chunk has arrived:
once a stream has yielded, its errors propagate.
"""

from baton_client.aio import AsyncClient
from baton_client.errors import BatonError
from baton_client.request import generate_request, tokenize_request
from baton_client.results import Chunk, Completion, ModelInfo, Timings, ToolCall, Usage
from baton_client.retry import RetryPolicy
from baton_client.sync import Client

__all__ = ["AsyncClient", "BatonError", "Chunk", "Client", "Completion", "ModelInfo",
           "RetryPolicy", "Timings", "ToolCall", "Usage", "generate_request",
           "tokenize_request"]

"""The abuse suite's gRPC requests, sent to VllmEngine's Generate on the same router: the
ids packed a byte each, a million choices, twenty thousand long stop strings, a group in
front of millions of unknown fields, 8 MB of text and of request id, a giant multimodal
payload. Each is counted on its wire bytes (router/vllm_wire.py) and refused naming its
field while a poller of /health sees every answer, as baton.v1's are; then a normal
request is served by both APIs."""

from __future__ import annotations

import asyncio

from smg_grpc_proto.generated import vllm_engine_pb2 as vllm

from tests.integration.test_abuse import (
    MILLION,
    _number,
    _poll,
    _send_all,
    served_as_ever,
    serving_router,
)
from tests.router_fakes import PROMPT, expected
from tests.unit.test_limits import _group, _len_field

GENERATE = "/vllm.grpc.engine.VllmEngine/Generate"


def _request(**kw) -> bytes:
    return vllm.GenerateRequest(request_id="r", **kw).SerializeToString()


def _sampling(raw: bytes) -> bytes:
    return _request(text="hi") + _len_field(_number(vllm.GenerateRequest, "sampling_params"),
                                            raw)


def _requests() -> list[tuple[str, bytes, str]]:
    """(method, request bytes, the field its refusal names)"""
    ids = _len_field(_number(vllm.TokenizedInput, "input_ids"), b"\x05" * (16 * MILLION))
    choices = _len_field(_number(vllm.SamplingParams, "choice"),
                         _len_field(_number(vllm.ChoiceConstraint, "choices"), b"a")
                         * MILLION)
    unknown = b"".join([b"\xf8\x3e\x01"] * (2 * MILLION))  # field 999, varint 1
    return [
        (GENERATE, _request() + _len_field(_number(vllm.GenerateRequest, "tokenized"), ids),
         "tokenized.input_ids"),
        (GENERATE, _sampling(choices), "sampling_params.choice"),
        (GENERATE, _request(text="hi", sampling_params=vllm.SamplingParams(
            stop=["x" * 200] * 20_000)), "sampling_params.stop"),
        (GENERATE, _group(2000) + unknown, "request"),
        (GENERATE, _request(text="a" * (8 << 20)), "text"),
        (GENERATE, vllm.GenerateRequest(request_id="r" * (8 << 20), text="hi")
         .SerializeToString(), "request_id"),
        (GENERATE, _request(text="hi", mm_inputs=vllm.MultimodalInputs(
            pixel_values=vllm.TensorData(inline=b"\0" * (8 << 20)))), "mm_inputs"),
    ]


def test_giant_vllm_requests_are_refused_naming_their_field_while_health_answers(tok):
    requests = _requests()

    async def main():
        async with serving_router(tok) as (c, base, client):
            stop, latencies = asyncio.Event(), []
            poller = asyncio.ensure_future(_poll(f"{base}/health", stop, latencies))
            results = await _send_all(base, c.address, [], requests)
            stop.set()
            await poller
            await served_as_ever(client, c)
            req = vllm.GenerateRequest(request_id="ok", stream=False,
                                       tokenized=vllm.TokenizedInput(input_ids=PROMPT),
                                       sampling_params=vllm.SamplingParams(max_tokens=4))
            (done,) = [m async for m in c.vllm.Generate(req, timeout=10)]
            assert list(done.complete.output_ids) == expected(PROMPT, 4)
        return results, latencies

    results, latencies = asyncio.run(main())
    assert len(results) == len(requests)
    for r in results:
        assert r["status"] == "INVALID_ARGUMENT" and r["param"] == r["want"], r
        assert r["took"] < 2.0, r
    assert max(latencies) < 0.5, sorted(latencies)[-3:]

"""vllm.grpc.engine.VllmEngine on the router's port (router/vllm_engine.py), in front of
fake workers: the same tokens as baton.v1's Generate, in vLLM's servicer's messages; every
field Baton does not take refused naming it, before any worker is called; Abort and a
client that leaves free the request everywhere; what GetLoads, GetModelInfo,
GetTokenizer and SubscribeKvEvents say, against the fakes' own state; API keys as for
baton.v1."""

from __future__ import annotations

import asyncio
import hashlib
import io
import zipfile

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2 as common
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm
from transformers import PreTrainedTokenizerFast

from baton.services.common.block_hash import extend_hashes
from baton.services.common.tokenizer import Tokenizer, tokenizer_dir
from tests.router_fakes import PROMPT, cluster, expected, tokens

KEY = "k" * 32


def generate(prompt=PROMPT, max_tokens: int = 6, stream: bool = True, rid: str = "r1",
             **sampling) -> vllm.GenerateRequest:
    return vllm.GenerateRequest(
        request_id=rid, tokenized=vllm.TokenizedInput(input_ids=prompt), stream=stream,
        sampling_params=vllm.SamplingParams(**{"temperature": 0, "max_tokens": max_tokens,
                                               **sampling}))


async def replies(c, req, **kw) -> list[vllm.GenerateResponse]:
    return [m async for m in c.vllm.Generate(req, timeout=10, **kw)]


def test_generate_streams_baton_v1s_tokens_as_vllms_servicer_does(tok):
    async def main():
        async with cluster(tok) as c:
            own = await c.generate(PROMPT, 6)
            want = tokens(own)
            assert want == expected(PROMPT, 6)
            streamed = await replies(c, generate(logprobs=2))
            chunks = [m.chunk for m in streamed if m.HasField("chunk")]
            (done,) = [m.complete for m in streamed if m.HasField("complete")]
            assert streamed[-1].HasField("complete")
            assert [t for ch in chunks for t in ch.token_ids] == want
            assert all(ch.completion_tokens == len(ch.token_ids) for ch in chunks)
            assert {ch.prompt_tokens for ch in chunks} == {len(PROMPT)}
            # The completion repeats the last chunk's tokens (vLLM's DELTA outputs).
            assert list(done.output_ids) == list(chunks[-1].token_ids)
            assert (done.finish_reason, done.prompt_tokens) == ("length", len(PROMPT))
            # logprobs 2: the sampled token's, and the first 2 distinct of baton.v1's
            # list (the sampled token first, then the top N, where it recurs).
            lp = [x for ch in chunks for x in ch.output_logprobs.top_logprobs]
            for t, top in zip(want, lp, strict=True):
                assert list(top.token_ids) == [t, t + 1]
                assert list(top.values) == [-0.5, -1.5]
            whole = await replies(c, generate(stream=False))
            (only,) = whole
            assert list(only.complete.output_ids) == want
            assert only.complete.completion_tokens == 6
            assert not only.complete.HasField("output_logprobs")

    asyncio.run(main())


def test_n_choices_each_stream_with_its_index(tok):
    async def main():
        async with cluster(tok) as c:
            out = await replies(c, generate(n=3, stream=False))
            done = sorted((m.complete.index, list(m.complete.output_ids)) for m in out)
            assert done == [(i, expected(PROMPT, 6)) for i in range(3)]
            assert c.router.inflight == 0

    asyncio.run(main())


REFUSED = [
    ("kv_transfer_params", dict(kv_transfer_params=vllm.KvTransferParams(remote_port=1))),
    ("kv_transfer_params_json", dict(kv_transfer_params_json="{}")),
    ("mm_inputs", dict(mm_inputs=vllm.MultimodalInputs())),
    ("extra_mm_inputs", dict(extra_mm_inputs=[vllm.MultimodalInputs()])),
    ("media_refs", dict(media_refs=vllm.MediaRefs())),
    ("data_parallel_rank", dict(data_parallel_rank=1)),
]
SAMPLING_REFUSED = [
    ("sampling_params.structural_tag", dict(structural_tag="{}")),
    ("sampling_params.prompt_logprobs", dict(prompt_logprobs=1)),
    ("sampling_params.logprobs", dict(logprobs=-1)),
    ("sampling_params.truncate_prompt_tokens", dict(truncate_prompt_tokens=0)),
    ("sampling_params.n", dict(n=1000)),
    ("sampling_params.temperature", dict(temperature=-1.0)),
    ("sampling_params.stop_token_ids", dict(stop_token_ids=[1] * 2000)),
]


def test_every_field_baton_does_not_take_is_refused_naming_it(tok):
    async def main():
        async with cluster(tok) as c:
            cases = [(name, vllm.GenerateRequest(
                request_id="r", tokenized=vllm.TokenizedInput(input_ids=PROMPT),
                sampling_params=vllm.SamplingParams(max_tokens=4), **fields))
                for name, fields in REFUSED]
            cases += [(name, generate(**fields)) for name, fields in SAMPLING_REFUSED]
            cases.append(("input", vllm.GenerateRequest(request_id="r")))
            for name, req in cases:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await replies(c, req)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
                assert name.split(".")[-1] in e.value.details(), (name, e.value.details())
            assert not c.prefill[0].prefills and not c.decode[0].decodes  # no worker called
            assert c.router.inflight == 0

    asyncio.run(main())


def test_abort_and_a_client_that_leaves_free_the_request_everywhere(tok):
    async def main():
        async with cluster(tok) as c:
            d = c.decode[0]
            d.gate, d.ungated = asyncio.Event(), 2
            call = c.vllm.Generate(generate(max_tokens=50, rid="held"), timeout=10)
            first = await call.read()
            assert first.HasField("chunk")
            while not d.blocks:
                await asyncio.sleep(0.01)
            await c.vllm.Abort(vllm.AbortRequest(request_ids=["held"]))
            rest = []
            while (m := await call.read()) is not grpc.aio.EOF:
                rest.append(m)
            assert rest[-1].complete.finish_reason == "abort"
            while d.blocks or c.router.inflight:
                await asyncio.sleep(0.01)
            # A client that leaves mid-stream: its call cancelled, its blocks freed.
            call = c.vllm.Generate(generate(max_tokens=50, rid="left"), timeout=10)
            await call.read()
            while not d.blocks:
                await asyncio.sleep(0.01)
            call.cancel()
            for _ in range(500):
                if not d.blocks and not c.router.inflight and not c.leases_held():
                    break
                await asyncio.sleep(0.01)
            assert not d.blocks and not c.router.inflight and not c.leases_held()

    asyncio.run(main())


def test_loads_model_info_and_health_say_what_the_router_knows(tok):
    async def main():
        async with cluster(tok) as c:
            await c.polled()
            loads = (await c.vllm.GetLoads(vllm.GetLoadsRequest())).loads
            (load,) = loads
            stats = [w.stats for w in c.registry.workers]
            block = stats[0].model_info.block_size
            assert load.max_total_num_tokens == sum(s.num_blocks for s in stats) * block
            assert load.num_running_reqs == sum(s.num_running for s in stats)
            assert load.max_running_requests == c.router.max_inflight
            info = await c.vllm.GetModelInfo(vllm.GetModelInfoRequest())
            own = c.router.model_info()
            assert (info.max_context_length, info.vocab_size, list(info.eos_token_ids)) == (
                own.max_model_len, own.vocab_size, list(own.eos_token_ids))
            health = await c.vllm.HealthCheck(vllm.HealthCheckRequest())
            assert health.healthy

    asyncio.run(main())


def test_get_tokenizer_streams_the_routers_tokenizer_as_one_zip(tok, tmp_path):
    async def main():
        async with cluster(tok) as c:
            return [m async for m in c.vllm.GetTokenizer(common.GetTokenizerRequest())]

    chunks = asyncio.run(main())
    data = b"".join(ch.data for ch in chunks)
    assert [bool(ch.sha256) for ch in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    zipfile.ZipFile(io.BytesIO(data)).extractall(tmp_path)
    loaded = PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    own = Tokenizer(tok)
    text = "Paged KV blocks move between workers."
    assert loaded.encode(text) == own.encode(text)
    assert loaded.chat_template == PreTrainedTokenizerFast.from_pretrained(
        str(tokenizer_dir(tok))).chat_template


def test_kv_events_store_and_remove_the_blocks_of_requests_served_here(tok):
    async def main():
        async with cluster(tok) as c:
            await replies(c, generate(max_tokens=2))  # the decode fake caches PROMPT
            await c.polled()
            stream = c.vllm.SubscribeKvEvents(common.SubscribeKvEventsRequest())
            first = await asyncio.wait_for(stream.read(), 10)
            hashes: list[bytes] = []
            extend_hashes(hashes, PROMPT, 16)
            for w in c.prefill + c.decode:  # every engine that held it evicts block 2
                w.kv.removed(hashes[1])
            second = await asyncio.wait_for(stream.read(), 10)
            stream.cancel()
            return first, second

    first, second = asyncio.run(main())
    assert first.events[0].HasField("cleared")
    stored = [e.stored for e in first.events if e.HasField("stored")]
    # PROMPT's 40 tokens: two full blocks, the second's parent the first.
    assert [list(s.blocks[0].token_ids) for s in stored] == [PROMPT[:16], PROMPT[16:32]]
    assert not stored[0].HasField("parent_block_hash")
    assert stored[1].parent_block_hash == stored[0].blocks[0].block_hash
    (event,) = second.events
    assert list(event.removed.block_hashes) == [stored[1].blocks[0].block_hash]
    assert second.sequence_number == first.sequence_number + 1


def test_api_keys_hold_as_for_baton_v1(tok):
    async def main():
        async with cluster(tok, api_keys=(KEY,)) as c:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await replies(c, generate())
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await c.vllm.GetModelInfo(vllm.GetModelInfoRequest())
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            # HealthCheck needs no key (as gRPC's own health service): it answers.
            assert (await c.vllm.HealthCheck(vllm.HealthCheckRequest())).healthy
            out = await replies(c, generate(), metadata=(("authorization",
                                                         f"Bearer {KEY}"),))
            assert [t for m in out if m.HasField("chunk") for t in m.chunk.token_ids] == \
                expected(PROMPT, 6)
            own = await c.generate(PROMPT, 6, key=KEY)
            assert tokens(own) == expected(PROMPT, 6)

    asyncio.run(main())

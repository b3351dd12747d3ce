"""An fp8 KV cache (--kv-cache-dtype) on the tiny serving model: chunking a prompt does not
change its greedy tokens, a P/D pair over the gRPC stream's byte codec equals one fp8
engine and frees every block, a pair that disagrees on the KV dtype or its scales is
refused, naming the field, and the same KV budget holds twice the blocks of bf16."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch

from baton.kv_transfer.base import IncompatibleLayout, KVHandle
from baton.kv_transfer.blocks import read_blocks
from baton.kv_transfer.grpc_stream import GrpcStreamReceiver
from baton.services.engine import SamplingParams
from baton.services.engine.loader import hf_dir_config
from baton.services.engine.model_runner import kv_bytes_per_block
from baton.services.rpc.errors import FailedPrecondition
from tests.integration.engine_helpers import assert_idle, kv_gib
from tests.integration.test_layout_handshake import _connect, _prefill

PROMPTS = [
    "The capital of France is",
    "Write a haiku about paged attention and memory blocks in a serving system, "
    "then explain it line by line to a reader who has never seen a GPU.",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22,",
]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=3)


def _fp8(make_llm, tiny_model, **kw):
    kw.setdefault("max_num_batched_tokens", 128)
    return make_llm(model=str(tiny_model), dtype="float32", kv_cache_dtype="fp8_e4m3", **kw)


@pytest.fixture(scope="module")
def fp8(make_llm, tiny_model):
    return _fp8(make_llm, tiny_model)


def test_chunked_prefill_gives_the_tokens_of_a_whole_prompt(fp8, make_llm, tiny_model):
    """Chunks of 7 tokens read their own K/V back from the cache as later chunks do: the
    same greedy tokens and log-probabilities as one pass over each prompt."""
    chunked = _fp8(make_llm, tiny_model, max_num_batched_tokens=7, max_num_seqs=1,
                   enable_prefix_caching=False)
    whole = [fp8.generate(p, GREEDY)[0] for p in PROMPTS]
    parts = [chunked.generate(p, GREEDY)[0] for p in PROMPTS]
    assert [o.token_ids for o in parts] == [o.token_ids for o in whole]
    for a, b in zip(parts, whole, strict=True):
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert x.keys() == y.keys()
            assert x == pytest.approx(y, abs=1e-4)
    assert_idle(chunked)


def _fetch_from(p):
    """The gRPC stream's fetch, in process: the blocks' bytes (kv_transfer/blocks.py) in
    uneven messages, as ReadKvBlocks streams them."""
    def fetch(handle: KVHandle, block_ids: list[int], heads: range):
        assert heads == range(p.kv_layout.num_kv_heads)  # one rank: every head
        data = read_blocks(p.kv_caches, block_ids)
        step = max(1, p.kv_layout.block_bytes * 2 // 3)
        for i in range(0, len(data), step):
            yield data[i:i + step]
    return fetch


def _pair(make_llm, tiny_model, decode_kw):
    p = _fp8(make_llm, tiny_model, max_num_batched_tokens=64).engine
    made = {}

    def receiver(layout, kv_caches):
        made["r"] = GrpcStreamReceiver(layout, kv_caches, _fetch_from(p))
        return made["r"]

    d = make_llm(model=str(tiny_model), dtype="float32", kv_receiver=receiver,
                 **decode_kw).engine
    return p, d, made["r"]


def _drain(engine):
    outs: dict[str, list] = {}
    deadline = time.monotonic() + 120
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the engine did not drain"
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def test_pd_over_the_grpc_stream_equals_one_fp8_engine_and_frees_every_block(
        fp8, make_llm, tiny_model):
    p, d, receiver = _pair(make_llm, tiny_model, {"kv_cache_dtype": "fp8_e4m3"})
    receiver.add_peer("prefill-0", p.kv_layout, b"")
    params = SamplingParams(max_tokens=24, temperature=0.0)
    want = fp8.generate(PROMPTS, params)
    for i, prompt in enumerate(PROMPTS):
        p.add_request(prompt, params, request_id=f"r{i}", kv_hold=True)
    firsts = {rid: outs[-1] for rid, outs in _drain(p).items()}
    for rid, o in firsts.items():
        handle = KVHandle("prefill-0", rid, o.kv_lease_id, tuple(o.kv_block_ids),
                          len(o.prompt_token_ids), verified=True)
        d.add_remote_request(o.prompt_token_ids, o.new_token_ids[0], handle, params,
                             request_id=rid)
    outs = _drain(d)
    for rid in firsts:
        assert p.release_lease(rid, firsts[rid].kv_lease_id)
    texts = [firsts[f"r{i}"].new_text + "".join(o.new_text for o in outs[f"r{i}"])
             for i in range(len(PROMPTS))]
    assert texts == [o.text for o in want]
    assert all(outs[f"r{i}"][-1].transfer_time is not None for i in range(len(PROMPTS)))
    assert d.stats().num_blocks_pulled > 0 and d.stats().num_load_failures == 0
    for engine in (p, d):
        assert not engine.has_unfinished_requests()
        engine.pool.check_all_free()
    receiver.close()


def test_a_pair_that_disagrees_on_the_kv_dtype_is_refused_naming_it(make_llm, tiny_model):
    p, d, receiver = _pair(make_llm, tiny_model, {})  # the decode side stores fp32
    assert d.kv_layout.dtype == "float32" and p.kv_layout.dtype == "float8_e4m3fn"
    with pytest.raises(IncompatibleLayout, match="dtype: ours 'float32', peer "
                                                 "'float8_e4m3fn'"):
        receiver.add_peer("prefill-0", p.kv_layout, b"")
    # The same at the workers' handshake, over gRPC, in both directions (the prefill
    # worker refuses, and says whose is which).
    with pytest.raises(FailedPrecondition, match="dtype: ours 'float8_e4m3fn', peer "
                                                 "'float32'"):
        _connect(d.kv_layout, _prefill(p.kv_layout))
    with pytest.raises(FailedPrecondition, match="dtype: ours 'float32', peer "
                                                 "'float8_e4m3fn'"):
        _connect(p.kv_layout, _prefill(d.kv_layout))
    receiver.close()


def test_pairs_that_disagree_on_e4m3_and_e5m2_or_on_the_scales_are_refused(fp8):
    ours = fp8.engine.kv_layout
    assert ours.kv_scales == "1"  # the tiny checkpoint has no k_scale/v_scale: all 1.0
    for field, other in (("dtype", "float8_e5m2"), ("kv_scales", "0123456789abcdef")):
        theirs = replace(ours, **{field: other})
        with pytest.raises(FailedPrecondition, match=f"{field}: ours '{other}', peer "
                                                     f"'{getattr(ours, field)}'"):
            _connect(ours, _prefill(theirs))


def test_the_same_budget_holds_twice_the_blocks_of_bf16(make_llm, tiny_model):
    mc = hf_dir_config(tiny_model)
    gib = kv_gib(tiny_model, 40)  # 41 fp32 blocks: 82 of bf16, 164 of fp8
    bf16 = make_llm(model=str(tiny_model), dtype="bfloat16", kv_cache_gib=gib).engine
    fp8 = make_llm(model=str(tiny_model), dtype="bfloat16", kv_cache_gib=gib,
                   kv_cache_dtype="fp8").engine
    assert fp8.runner.kv_caches[0].dtype == torch.float8_e4m3fn
    assert fp8.pool.num_blocks == 2 * bf16.pool.num_blocks
    # The bytes as stored: the cache's, a block's (what /metrics counts pulls in), and
    # the same total for the same budget.
    assert fp8.kv_layout.block_bytes * 2 == bf16.kv_layout.block_bytes
    assert fp8.kv_layout.block_bytes == kv_bytes_per_block(mc, 16, torch.float8_e4m3fn)
    assert fp8.runner.kv_cache_bytes == bf16.runner.kv_cache_bytes


def test_the_checkpoints_scales_are_read_and_go_into_the_layout(fp8, make_llm, tiny_model,
                                                               tmp_path):
    import shutil

    from safetensors.torch import save_file

    folder = tmp_path / "scaled"
    shutil.copytree(tiny_model, folder)
    save_file({"model.layers.0.self_attn.k_scale": torch.tensor(0.5),
               "model.layers.1.self_attn.kv_scale": torch.tensor([2.0])},
              str(folder / "kv_scales.safetensors"))
    scaled = make_llm(model=str(folder), dtype="float32", kv_cache_dtype="fp8").engine
    attn = [layer.self_attn for layer in scaled.runner.model.decoder_layers]
    assert [(a.k_scale, a.v_scale) for a in attn[:2]] == [(0.5, 1.0), (2.0, 2.0)]
    assert scaled.kv_layout.kv_scales not in ("", "1")
    with pytest.raises(IncompatibleLayout, match="kv_scales: ours '1', peer"):
        fp8.engine.kv_layout.check_compatible(scaled.kv_layout)

"""The Triton kernels against the pure-torch reference. Without CUDA they run under
Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before triton loads)."""

from __future__ import annotations

import os
import random

import pytest
import torch

from baton.kernels import kv_layout, reference
from baton.kernels.metadata import AttentionMetadata
from tests.kernel_batch import make_batch as _make_batch

triton_attn = pytest.importorskip(
    "baton.kernels.triton_attn", reason="triton is not installed: the Triton kernels are untested")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA and TRITON_INTERPRET is not 1: Triton cannot run the kernels",
                allow_module_level=True)

TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _check(seed, block_size, num_kv_heads, group, head_dim, dtype, decodes, prefills,
           window=None, softcap=None, **batch):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    q, k, v, cache, meta = _make_batch(rng, block_size, num_kv_heads, group, head_dim,
                                       dtype, decodes, prefills, **batch)
    # Cache write: exact bytes, against the reference's write.
    ref_cache = cache.clone()
    reference.reshape_and_cache(k, v, ref_cache, meta.slot_mapping)
    dev_cache = cache.to(DEVICE)
    meta = meta.to(DEVICE)
    triton_attn.reshape_and_cache(k.to(DEVICE), v.to(DEVICE), dev_cache, meta.slot_mapping)
    assert torch.equal(dev_cache.cpu(), ref_cache)
    # Attention: within the dtype's rounding of an fp32 reference on the same inputs.
    scale = head_dim**-0.5
    want = reference.paged_attention(q.float(), None, None, ref_cache.float(), meta, scale,
                                     window, softcap)
    if window is not None:
        # NaN into the blocks wholly before the first key that a request's first new token
        # sees: the kernel must start its key loop after them.
        bs, poisoned = block_size, 0
        dev_kc, dev_vc = kv_layout.head_views(dev_cache)
        for i in range(meta.num_seqs):
            q_len = meta.query_start_loc_cpu[i + 1] - meta.query_start_loc_cpu[i]
            first_key = max(0, meta.seq_lens_cpu[i] - q_len - window + 1)
            blocks = meta.block_tables[i, :first_key // bs].long()
            dev_kc[:, blocks] = float("nan")
            dev_vc[:, blocks] = float("nan")
            poisoned += len(blocks)
        assert poisoned or window > meta.max_seq_len
    got = triton_attn.paged_attention(q.to(DEVICE), None, None, dev_cache, meta, scale,
                                      window=window, softcap=softcap)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float().cpu(), want, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("decodes,prefills", [(6, 0), (2, 3)])
def test_gqa_decode_and_prefill_over_cached_prefix(dtype, head_dim, block_size, decodes,
                                                   prefills):
    """GQA (4 query heads per KV head); prefill chunks start after random cached prefixes,
    some mid-block; decodes of random lengths."""
    _check(hash((dtype, head_dim, block_size, decodes)) % 1000, block_size, 2, 4, head_dim,
           dtype, decodes, prefills)


@pytest.mark.parametrize("block_size", [1, 8, 16])
@pytest.mark.parametrize("num_kv_heads,group", [(3, 3), (1, 8), (4, 1)])
def test_fp32_odd_groups_and_small_blocks(block_size, num_kv_heads, group):
    """A group that is not a power of two (SmolLM2's 3), MQA, MHA; blocks smaller than a
    key tile, so one tile spans several pages. fp32 is compared tightly."""
    _check(block_size * 31 + group, block_size, num_kv_heads, group, 64, torch.float32, 3, 2)


def test_head_dim_not_a_power_of_two():
    _check(5, 16, 2, 2, 80, torch.float32, 2, 2)


@pytest.mark.parametrize("window,softcap", [(1, None), (5, None), (37, None), (1000, None),
                                            (None, 2.0), (5, 2.0), (37, 2.0)])
@pytest.mark.parametrize("block_size", [8, 16])
def test_sliding_window_and_softcap(block_size, window, softcap):
    """Sliding window (one key, less than a block, not a multiple of one, more than any
    sequence) and soft-capping, alone and together. Group 3 pads query rows; chunks of up
    to 30 tokens span two query tiles, whose second starts its key loop later."""
    seed = block_size * 1000 + (window or 0) + int(softcap or 0)
    _check(seed, block_size, 2, 3, 16, torch.float32, 3, 3, window, softcap, max_prefix=100,
           max_chunk=30)


@pytest.mark.parametrize("window", [5, 20])
def test_sliding_window_rows_that_see_no_key_in_a_tile(window):
    """MHA: 64 new tokens per query tile, more than a key tile (32), so a tile's later
    rows see no key in the first key tiles, which start at the first row's window. Their
    running max stays -inf there, and must not turn their sums into NaN."""
    _check(window, 16, 2, 1, 16, torch.float32, 1, 3, window, None, max_prefix=80,
           max_chunk=64)


def test_sliding_window_and_softcap_bf16():
    _check(9, 16, 2, 4, 64, torch.bfloat16, 4, 2, 21, 2.0)


def test_padding_rows_of_a_graph_batch_touch_only_the_null_block():
    """A CUDA-graph batch pads with rows of length 1 over the null block: they must read
    and write only block 0, and real rows must be unaffected by the full table width."""
    torch.manual_seed(0)
    bs, kvh, group, d = 16, 3, 3, 64
    cache = torch.randn(kv_layout.shape(32, kvh, bs, d))
    cache[0] = 0  # the null block, K and V
    lens = [37, 5, 1, 1]  # two real decodes, two padding rows
    table = torch.tensor([[3, 4, 5, 0, 0, 0], [7, 0, 0, 0, 0, 0], [0] * 6, [0] * 6],
                         dtype=torch.int32)
    slots = torch.tensor([5 * bs + 4, 7 * bs + 4, 0, 0])
    meta = AttentionMetadata(
        slot_mapping=slots, query_start_loc=torch.arange(5, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=table, num_decodes=4,
        query_start_loc_cpu=list(range(5)), seq_lens_cpu=lens, max_seq_len=6 * bs,
        max_query_len=1, decode_max_seq_len=6 * bs,
    )
    q = torch.randn(4, kvh * group, d)
    k, v = torch.randn(4, kvh, d), torch.randn(4, kvh, d)
    k[2:], v[2:] = 0, 0
    before = cache.clone()
    dev_cache = cache.to(DEVICE)
    meta = meta.to(DEVICE)
    triton_attn.reshape_and_cache(k.to(DEVICE), v.to(DEVICE), dev_cache, meta.slot_mapping)
    # K and V, each [kv_heads, blocks, bs, d]: the (block, offset) rows that changed
    for now, then in zip(kv_layout.head_views(dev_cache.cpu()), kv_layout.head_views(before),
                         strict=True):
        changed = (now != then).any(-1).any(0).nonzero().tolist()
        assert changed == [[5, 4], [7, 4]]  # (block, offset) of the two real tokens only
    got = triton_attn.paged_attention(q.to(DEVICE), None, None, dev_cache, meta, 0.125)
    want = reference.paged_attention(q, None, None, dev_cache.cpu(), meta, 0.125)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def head_shaped_model(tmp_path_factory, model_path):
    """A 2-layer random Llama with SmolLM2's head shapes (64-dim heads, 3 query heads per
    KV head) as an HF directory: the interpreter runs it in seconds, not minutes. Its
    vocabulary is the tokenizer's first 1024 tokens (the attention is what is tested)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from baton.services.common.tokenizer import load_tokenizer

    torch.manual_seed(0)
    tok = load_tokenizer(model_path)
    cfg = LlamaConfig(vocab_size=1024, hidden_size=384, intermediate_size=512,
                      num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                      head_dim=64, max_position_embeddings=512, tie_word_embeddings=False,
                      initializer_range=0.2, eos_token_id=2, bos_token_id=1)
    hf = LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("tiny-llama")
    hf.save_pretrained(path)
    tok.save_pretrained(path)
    return path, hf


@pytest.mark.slow
def test_engine_with_triton_kernels_equals_hf_and_torch_backend(make_llm, head_shaped_model):
    """The whole model through the Triton kernels: chunked prefill over a cached prefix
    (chunks of 24 tokens), mixed decode and prefill steps, then padded full-width decode
    batches as a CUDA graph runs them. Same greedy tokens as HF and the torch backend."""
    from baton.services.engine import SamplingParams
    from baton.services.engine.cuda_graphs import CudaGraphRunner

    path, hf = head_shaped_model
    n_new = 5  # enough for decodes beside a prefill, and all three in a padded batch
    common = dict(model=str(path), dtype="float32", max_num_batched_tokens=24,
                  max_num_seqs=4, device=DEVICE, kv_cache_gib=0.02)
    base = make_llm(**common)
    tri = make_llm(attention_backend="triton", **common)
    assert tri.engine.runner.backend is triton_attn
    shared = [(j * 7919) % 900 + 100 for j in range(40)]
    prompts = [shared + [101 + i] * (3 + 5 * i) for i in range(3)]
    params = SamplingParams(max_tokens=n_new, temperature=0, ignore_eos=True)
    want = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new,
                              min_new_tokens=n_new, do_sample=False, pad_token_id=0)
        want.append(ref[0, len(prompt):].tolist())
    assert [o.token_ids for o in base.generate(prompts, params)] == want
    outs = tri.generate(prompts, params)
    assert [o.token_ids for o in outs] == want
    assert outs[2].num_cached_tokens == 32, "the last prompt was meant to hit the cache"
    runner = tri.engine.runner
    if runner.graphs is None:  # CPU: the graph runner's padded batches, run eagerly
        runner.graphs = CudaGraphRunner(runner.model, runner.kv_caches, 4, 8, runner.device)
    tri.reset_prefix_cache()
    assert [o.token_ids for o in tri.generate(prompts, params)] == want


@pytest.mark.parametrize("fmt", ["int8", "q8_0", "q4_0", "q4_1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_matmul_matches_the_dequantized_weights(fmt, dtype):
    """kernels/triton_quant.py against x @ (the weights dequantized in fp32).T: 70 weight
    rows (a partial tile of 64), 19 rows of x (a partial tile of 16)."""
    from baton.kernels import quant, triton_quant
    from tests.integration.test_quantized_models import _weight

    w = _weight(fmt, 70, 64)
    x = torch.randn(19, 64).to(dtype)
    want = x.float() @ w.dequantize().T
    scale = None if w.scale is None else w.scale.to(DEVICE)
    got = triton_quant.qmm(x.to(DEVICE), w.data.to(DEVICE), scale, quant.KERNEL_FORMAT[fmt],
                           quant.BLOCK_BYTES.get(fmt, quant.BLOCK), w.n, w.k).float().cpu()
    tol = TOL[dtype] if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())

"""The fast attention path and cache write against the pure-torch reference."""

from __future__ import annotations

import random

import pytest
import torch

from baton.kernels import cpu_ops, kv_layout, reference, torch_attn
from baton.kernels.metadata import AttentionMetadata, count_shared_blocks
from tests.kernel_batch import make_batch as _make_batch


@pytest.fixture(autouse=True)
def decode_path(monkeypatch):
    """Decode rows through the torch path here. The C++ kernel it replaces where it builds
    (kernels/cpu_ops.py) is built by a compiler, a process of its own:
    tests/integration/test_cpu_kernels.py runs these tests again through it, on every ISA."""
    monkeypatch.setattr(cpu_ops, "serves", lambda kernel, device: None)
    return "torch decode"


@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
@pytest.mark.parametrize("num_kv_heads,group", [(1, 1), (2, 4), (3, 3), (4, 1)])
@pytest.mark.parametrize("decodes,prefills", [(5, 0), (0, 4), (3, 3)])
def test_attention_matches_reference(block_size, num_kv_heads, group, decodes, prefills):
    rng = random.Random(hash((block_size, num_kv_heads, group, decodes, prefills)))
    torch.manual_seed(rng.randint(0, 1 << 30))
    head_dim = rng.choice([32, 64])
    q, k, v, cache, meta = _make_batch(rng, block_size, num_kv_heads, group, head_dim,
                                       torch.float32, decodes, prefills)
    cache2 = cache.clone()
    reference.reshape_and_cache(k, v, cache, meta.slot_mapping)
    torch_attn.reshape_and_cache(k, v, cache2, meta.slot_mapping)
    assert torch.equal(cache, cache2)
    scale = head_dim**-0.5
    want = reference.paged_attention(q, k, v, cache, meta, scale)
    got = torch_attn.paged_attention(q, k, v, cache2, meta, scale)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_attention_bf16_close_to_fp32_reference():
    rng = random.Random(7)
    q, k, v, cache, meta = _make_batch(rng, 16, 3, 3, 64, torch.bfloat16, 6, 3)
    torch_attn.reshape_and_cache(k, v, cache, meta.slot_mapping)
    want = reference.paged_attention(q.float(), k.float(), v.float(), cache.float(), meta,
                                     0.125)
    got = torch_attn.paged_attention(q, k, v, cache, meta, 0.125)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def test_cache_write_lands_in_the_right_slot():
    cache = torch.zeros(kv_layout.shape(4, 2, 16, 8))  # 4 blocks, 2 KV heads
    kc, vc = kv_layout.head_views(cache)  # [kv_heads, blocks, block_size, head_dim]
    key = torch.arange(1, 3 * 2 * 8 + 1, dtype=torch.float32).view(3, 2, 8)
    slots = torch.tensor([16 * 2 + 5, 16 * 3 + 0, 15])
    torch_attn.reshape_and_cache(key, -key, cache, slots)
    assert torch.equal(kc[:, 2, 5], key[0]) and torch.equal(kc[:, 3, 0], key[1])
    assert torch.equal(kc[:, 0, 15], key[2]) and torch.equal(vc[:, 0, 15], -key[2])
    assert torch.equal(vc[:, 2, 5], -key[0]) and torch.equal(vc[:, 3, 0], -key[1])
    # nothing else was written
    assert kc.abs().sum() == key.abs().sum() and vc.abs().sum() == key.abs().sum()


@pytest.mark.parametrize("dtype,shared_blocks,window,softcap", [
    (torch.float32, 1, None, None), (torch.float32, 3, None, None),
    (torch.bfloat16, 1, None, None), (torch.bfloat16, 3, None, None),
    # Sliding window / soft-capping layers (see WINDOW_SOFTCAP below).
    (torch.float32, 3, None, 2.0), (torch.bfloat16, 1, None, 2.0),
    (torch.float32, 3, 5, None), (torch.float32, 1, 37, 2.0), (torch.bfloat16, 3, 1000, None),
])
def test_decodes_sharing_prefix_blocks_match_reference(dtype, shared_blocks, window,
                                                        softcap):
    """Rows whose tables start with the same physical blocks (a cached prefix) take the
    cascade path: shared K/V read once (soft-capped too; a window skips it). Same result
    as the reference."""
    torch.manual_seed(shared_blocks)
    bs, kvh, group, d, n = 16, 3, 3, 64, 40  # 40 rows: more than one decode group
    cache = torch.randn(kv_layout.shape(512, kvh, bs, d), dtype=dtype)
    prefix = list(range(1, shared_blocks + 1))
    next_block = shared_blocks + 1
    tables, lens = [], []
    for i in range(n):
        length = shared_blocks * bs + 1 + (i * 7) % 50
        own = -(-length // bs) - shared_blocks
        tables.append(prefix + list(range(next_block, next_block + own)))
        next_block += own
        lens.append(length)
    width = max(map(len, tables))
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(n, dtype=torch.int64),
        query_start_loc=torch.arange(n + 1, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=table, num_decodes=n,
        query_start_loc_cpu=list(range(n + 1)), seq_lens_cpu=lens, max_seq_len=max(lens),
        max_query_len=1, decode_max_seq_len=max(lens),
        num_shared_blocks=count_shared_blocks(table, lens, bs),
    )
    assert meta.num_shared_blocks == shared_blocks
    q = torch.randn(n, kvh * group, d, dtype=dtype)
    want = reference.paged_attention(q.float(), None, None, cache.float(), meta, 0.125,
                                     window, softcap)
    got = torch_attn.paged_attention(q, None, None, cache, meta, 0.125, window, softcap)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype,window,softcap", [
    (torch.float32, None, None), (torch.bfloat16, None, None),
    (torch.float32, None, 2.0), (torch.bfloat16, None, 2.0), (torch.float32, 5, None),
    (torch.float32, 37, 2.0), (torch.float32, 1000, None),
])
def test_prefill_chunks_after_a_shared_prefix_match_reference(dtype, window, softcap):
    """Chunks whose cached prefixes start with the same blocks read those blocks once (also
    soft-capped; a window skips it); a fresh chunk and a chunk with less than a block
    cached take the plain paths."""
    torch.manual_seed(11)
    bs, kvh, group, d = 16, 3, 3, 64
    cache = torch.randn(kv_layout.shape(256, kvh, bs, d), dtype=dtype)
    shared = [1, 2, 3]
    # (cached prefix length, new tokens): fresh, short prefix, then shared-prefix chunks
    # with own cached tokens and chunks starting mid-block.
    rows = [(0, 20), (9, 5), (48, 7), (53, 30), (60, 1), (80, 16)]
    tables, lens, qsl, next_block = [], [], [0], 10
    for prefix, q_len in rows:
        seq_len = prefix + q_len
        nb = -(-seq_len // bs)
        head = shared[:min(3, prefix // bs)] if prefix >= bs else []
        own = list(range(next_block, next_block + nb - len(head)))
        next_block += len(own)
        tables.append(head + own)
        lens.append(seq_len)
        qsl.append(qsl[-1] + q_len)
    width = max(map(len, tables))
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    n = qsl[-1]
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(n, dtype=torch.int64),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=table, num_decodes=0,
        query_start_loc_cpu=qsl, seq_lens_cpu=lens, max_seq_len=max(lens),
        max_query_len=max(q for _, q in rows), decode_max_seq_len=0,
        num_shared_prefill_blocks=count_shared_blocks(
            table[2:], [p for p, _ in rows[2:]], bs),
    )
    assert meta.num_shared_prefill_blocks == 3
    q = torch.randn(n, kvh * group, d, dtype=dtype)
    k = torch.randn(n, kvh, d, dtype=dtype)
    v = torch.randn(n, kvh, d, dtype=dtype)
    # The fresh chunk reads its new K/V directly: write them so the reference sees them.
    slots = [t[p // bs] * bs + p % bs for t, (pre, ql) in zip(tables, rows, strict=True)
             for p in range(pre, pre + ql)]
    torch_attn.reshape_and_cache(k, v, cache, torch.tensor(slots))
    want = reference.paged_attention(q.float(), None, None, cache.float(), meta, 0.125,
                                     window, softcap)
    got = torch_attn.paged_attention(q, k, v, cache, meta, 0.125, window, softcap)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


# Sliding window (HF `sliding_window`: p - window < k <= p) and Gemma 2's soft-capping.
# Windows: a single key, less than a block, not a multiple of 8 or 16, more than
# any sequence here (so a window-only mask that must change nothing). A softcap of 2 bends
# scores of unit size noticeably.
WINDOW_SOFTCAP = [(1, None), (5, None), (37, None), (1000, None), (None, 2.0), (5, 2.0),
                  (37, 2.0)]


@pytest.mark.parametrize("window,softcap", [(1, None), (5, None), (13, None), (None, 1.5),
                                            (5, 1.5), (100, 1.5)])
def test_reference_window_and_softcap_match_dense_attention(window, softcap):
    """The ground truth itself: one 40-token sequence attended densely, [seq, seq] with a
    mask from positions, against the reference on decodes and chunks cut from it."""
    torch.manual_seed(3)
    seq, bs, kvh, group, d = 40, 8, 2, 2, 16
    Q = torch.randn(seq, kvh * group, d, dtype=torch.float64)
    K = torch.randn(seq, kvh, d, dtype=torch.float64)
    V = torch.randn(seq, kvh, d, dtype=torch.float64)
    scale = 0.3

    def dense(window, softcap):  # query i, key j, head h (reading kv head h // group)
        scores = torch.einsum("ihd,jhd->hij", Q, K.repeat_interleave(group, 1)) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        i, j = torch.arange(seq)[:, None], torch.arange(seq)[None, :]
        allowed = j <= i
        if window is not None:
            allowed = allowed & (i - j < window)  # the last `window` positions, i included
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        return torch.einsum("hij,jhd->ihd", probs, V.repeat_interleave(group, 1))

    want = dense(window, softcap)
    assert not torch.allclose(want, dense(None, None), atol=1e-3), "the test tests nothing"
    # Every request reads the same sequence, in the same (shuffled) blocks.
    blocks = torch.randperm(20)[:seq // bs] + 1
    cache = torch.full(kv_layout.shape(21, kvh, bs, d), float("nan"), dtype=torch.float64)
    kc, vc = kv_layout.head_views(cache)
    kc[:, blocks] = K.view(seq // bs, bs, kvh, d).permute(2, 0, 1, 3)
    vc[:, blocks] = V.view(seq // bs, bs, kvh, d).permute(2, 0, 1, 3)
    # (cached prefix, new tokens): decodes first, then a fresh chunk and cached-prefix ones.
    rows = [(0, 1), (8, 1), (20, 1), (39, 1), (0, 12), (13, 10), (30, 10)]
    qsl = [0]
    for _, q_len in rows:
        qsl.append(qsl[-1] + q_len)
    lens = [p + q for p, q in rows]
    positions = [p for pre, q_len in rows for p in range(pre, pre + q_len)]
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(len(positions), dtype=torch.int64),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=blocks.to(torch.int32).expand(len(rows), -1), num_decodes=4,
        query_start_loc_cpu=qsl, seq_lens_cpu=lens, max_seq_len=max(lens),
        max_query_len=12, decode_max_seq_len=40,
    )
    got = reference.paged_attention(Q[positions], None, None, cache, meta, scale,
                                    window=window, softcap=softcap)
    # The reference computes in fp32.
    torch.testing.assert_close(got, want[positions], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_size", [1, 8, 16])
@pytest.mark.parametrize("window,softcap", WINDOW_SOFTCAP)
def test_window_and_softcap_match_reference(block_size, window, softcap):
    """Mixed decodes and prefill chunks (fresh, and after cached prefixes starting
    mid-block), GQA, against the reference."""
    rng = random.Random(block_size * 1000 + (window or 0) + int(softcap or 0))
    torch.manual_seed(rng.randint(0, 1 << 30))
    q, k, v, cache, meta = _make_batch(rng, block_size, 2, 3, 32, torch.float32, 6, 4)
    torch_attn.reshape_and_cache(k, v, cache, meta.slot_mapping)
    want = reference.paged_attention(q, k, v, cache, meta, 0.2, window, softcap)
    got = torch_attn.paged_attention(q, k, v, cache, meta, 0.2, window=window,
                                     softcap=softcap)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_window_and_softcap_bf16_close_to_fp32_reference():
    rng = random.Random(8)
    q, k, v, cache, meta = _make_batch(rng, 16, 3, 3, 64, torch.bfloat16, 6, 3)
    torch_attn.reshape_and_cache(k, v, cache, meta.slot_mapping)
    want = reference.paged_attention(q.float(), k.float(), v.float(), cache.float(), meta,
                                     0.125, window=21, softcap=2.0)
    got = torch_attn.paged_attention(q, k, v, cache, meta, 0.125, window=21, softcap=2.0)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def _poison_outside_window(cache, meta, window):
    """NaN into every block wholly before the first key that a request's first new token
    sees: a path that reads any of them returns NaN. Returns how many were poisoned."""
    kc, vc = kv_layout.head_views(cache)
    bs = kv_layout.block_size(cache)
    count = 0
    for i in range(meta.num_seqs):
        q_len = meta.query_start_loc_cpu[i + 1] - meta.query_start_loc_cpu[i]
        first_key = max(0, meta.seq_lens_cpu[i] - q_len - window + 1)
        blocks = meta.block_tables[i, :first_key // bs].long()
        kc[:, blocks] = float("nan")
        vc[:, blocks] = float("nan")
        count += len(blocks)
    return count


@pytest.mark.parametrize("graph_width", [False, True])
@pytest.mark.parametrize("window", [3, 20])
def test_window_reads_only_the_blocks_it_touches(window, graph_width):
    """Decodes and cached-prefix chunks gather K/V from the block of their window's first
    key on: blocks before it hold NaN and the result still matches the reference (read
    from a clean cache). Also at a CUDA graph's full-table width for the decodes."""
    rng = random.Random(window)
    torch.manual_seed(window)
    q, k, v, cache, meta = _make_batch(rng, 8, 2, 2, 32, torch.float32, 5, 4,
                                       max_prefix=90)
    torch_attn.reshape_and_cache(k, v, cache, meta.slot_mapping)
    want = reference.paged_attention(q, k, v, cache, meta, 0.2, window=window)
    assert _poison_outside_window(cache, meta, window) > 5
    if graph_width:
        meta.decode_max_seq_len = meta.block_tables.shape[1] * 8
    got = torch_attn.paged_attention(q, k, v, cache, meta, 0.2, window=window)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)

"""Decode CUDA graphs: bucketing and padding logic on CPU (eager replay of the padded
batch), and real capture/replay where CUDA exists."""

from __future__ import annotations

import pytest
import torch

from baton.services.engine import SamplingParams
from baton.services.engine.cuda_graphs import CudaGraphRunner, batch_buckets


def test_buckets_cover_every_batch_size():
    for max_seqs in (1, 3, 8, 64, 100, 256):
        buckets = batch_buckets(max_seqs)
        assert buckets == sorted(set(buckets)) and buckets[-1] == max_seqs
        assert all(any(b >= n for b in buckets) for n in range(1, max_seqs + 1))
    assert batch_buckets(64)[:5] == [1, 2, 4, 8, 16]


def _prompts(llm, n):
    vocab = llm.engine.model_config.vocab_size
    return [[(i * 7919 + j * 104729) % (vocab - 100) + 100 for j in range(5 + 11 * i)]
            for i in range(n)]


@pytest.mark.slow
def test_padded_full_width_decode_equals_plain_decode(llm):
    """Decode batches padded to a bucket, over the block table's full width, with padding
    rows writing to the null block, give exactly the unpadded result."""
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    prompts = _prompts(llm, 5)  # 5 decodes pad to the bucket of 8
    prompts = [prompts[4] + p for p in prompts]  # a shared cached prefix, as in the field
    want = [o.token_ids for o in llm.generate(prompts, params)]
    runner = llm.engine.runner
    graphs = CudaGraphRunner(runner.model, runner.kv_caches, 16, 8, runner.device)
    runner.graphs = graphs
    used = []
    original = graphs.run
    graphs.run = lambda *a: used.append(a[0].shape[0]) or original(*a)
    try:
        got = [o.token_ids for o in llm.generate(prompts, params)]
    finally:
        runner.graphs = None
    assert used and max(used) == 5, "decode steps were meant to go through the graph runner"
    assert got == want


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no CUDA device: CUDA graph capture and replay need a GPU")
def test_cuda_graphs_equal_eager_on_gpu(make_llm):
    """Captured at start-up for every bucket, into one memory pool; replayed for every
    decode step (6 requests pad to the graph of 8); same tokens as eager."""
    eager = make_llm(dtype="float32", enforce_eager=True, max_num_seqs=8)
    graphed = make_llm(dtype="float32", enforce_eager=False, max_num_seqs=8)
    assert eager.engine.runner.graphs is None, "enforce_eager must turn graphs off"
    graphs = graphed.engine.runner.graphs
    assert graphs is not None and sorted(graphs.graphs) == graphs.buckets == [1, 2, 4, 8]
    assert graphs.pool is not None
    used = []
    original = graphs.run
    graphs.run = lambda *a: used.append(a[0].shape[0]) or original(*a)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompts = _prompts(eager, 6)
    try:
        got = [o.token_ids for o in graphed.generate(prompts, params)]
    finally:
        graphs.run = original
    assert used and max(used) == 6
    assert got == [o.token_ids for o in eager.generate(prompts, params)]

"""CUDA graphs for decode steps: captured once per bucketed batch size, replayed each step.

A decode batch of n requests is padded up to the nearest bucket (1, 2, 4, 8, then steps
of 8 up to 64 and of 16 beyond). Padding rows write their K/V to slot 0 of the null
block and attend to that one slot only, so they cannot touch any request's cache.
The attention kernel runs over the block table's full width (the graph is fixed), with
each row masked to its own length.

Without CUDA nothing is captured and `run` executes the same padded, full-width batch
eagerly: that is how the padding logic is tested on CPU.
"""

from __future__ import annotations

import logging

import torch

from baton.kernels import kv_layout
from baton.kernels.metadata import AttentionMetadata

log = logging.getLogger(__name__)


def batch_buckets(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 65, 8)) + list(range(80, 1025, 16))
    out = [s for s in sizes if s < max_num_seqs]
    return out + [max_num_seqs]


class CudaGraphRunner:
    def __init__(self, model, kv_caches: list[torch.Tensor], max_num_seqs: int,
                 max_blocks: int, device: torch.device):
        self.model = model
        self.kv_caches = kv_caches
        self.buckets = batch_buckets(max_num_seqs)
        self.max_batch = self.buckets[-1]
        self.max_blocks = max_blocks
        self.device = device
        b = self.max_batch
        # Static inputs: every graph reads from (slices of) these same tensors.
        self.input_ids = torch.zeros(b, dtype=torch.long, device=device)
        self.positions = torch.zeros(b, dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(b, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(b, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(b, max_blocks, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(b + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    def _meta(self, n: int) -> AttentionMetadata:
        width = self.max_blocks * kv_layout.block_size(self.kv_caches[0])
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:n], query_start_loc=self.query_start_loc[:n + 1],
            seq_lens=self.seq_lens[:n], block_tables=self.block_tables[:n], num_decodes=n,
            query_start_loc_cpu=list(range(n + 1)), seq_lens_cpu=[width] * n,
            max_seq_len=width, max_query_len=1, decode_max_seq_len=width,
            num_shared_blocks=0,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        if self.device.type != "cuda":
            return
        # Largest first, so smaller graphs reuse the memory pool the largest one made.
        for n in reversed(self.buckets):
            meta = self._meta(n)
            args = (self.input_ids[:n], self.positions[:n], self.kv_caches, meta)
            for _ in range(2):  # warm up kernels and the allocator outside the graph
                self.model(*args)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[n] = self.model(*args)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[n] = graph
        torch.cuda.synchronize(self.device)
        log.info("captured CUDA graphs for decode batch sizes %s", self.buckets)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
            seq_lens: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
        """One decode step of n requests. Inputs are host tensors (pinned on CUDA, so the
        copies into the static buffers are asynchronous); returns hidden states [n, H]."""
        n = input_ids.shape[0]
        bucket = next(b for b in self.buckets if b >= n)
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(slots, non_blocking=True)
        self.seq_lens[:n].copy_(seq_lens, non_blocking=True)
        self.block_tables[:n].zero_()
        self.block_tables[:n, :block_tables.shape[1]].copy_(block_tables, non_blocking=True)
        # Padding rows: token 0 at position 0, written to null-block slot 0, length 1.
        self.input_ids[n:bucket].zero_()
        self.positions[n:bucket].zero_()
        self.slot_mapping[n:bucket].zero_()
        self.seq_lens[n:bucket].fill_(1)
        self.block_tables[n:bucket].zero_()
        graph = self.graphs.get(bucket)
        if graph is None:  # not captured (CPU): run the padded batch eagerly
            meta = self._meta(bucket)
            return self.model(self.input_ids[:bucket], self.positions[:bucket],
                              self.kv_caches, meta)[:n]
        graph.replay()
        return self.outputs[bucket][:n]

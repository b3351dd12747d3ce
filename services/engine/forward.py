"""One forward pass as rank 0 builds it and every tensor-parallel rank runs it, and the
attention metadata it becomes (kernels/metadata.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from baton.kernels.metadata import AttentionMetadata, count_shared_blocks

from .sampler import to_device


@dataclass
class Forward:
    """One forward pass, as rank 0 sends it to every rank: the flat batch (one attention
    row per prefill chunk or decode token: kernels/metadata.py) and what to do with it."""

    ids: list[int]
    positions: list[int]
    qsl: list[int]  # query start of each row, and the end
    seq_lens: list[int]
    tables: list[list[int]]  # each row's block ids
    num_decodes: int
    max_query_len: int
    rows: list[int] | None = None  # the rows that sample; None: every row
    logits: bool = True  # whether any row samples
    lora_tokens: list[int] | None = None  # each token's LoRA slot (-1: none)
    lora_writes: list = field(default_factory=list)  # (slot, adapter) that rank 0 wrote

    def tensors(self, block_size: int, pin: bool = False) -> HostTensors:
        bs = block_size
        width = max(len(t) for t in self.tables)
        table = torch.tensor([t + [0] * (width - len(t)) for t in self.tables],
                             dtype=torch.int32)
        pos = torch.tensor(self.positions, dtype=torch.long)
        # Token t of row r lives in slot table[r, pos // bs] * bs + pos % bs.
        lens = torch.tensor([self.qsl[i + 1] - self.qsl[i] for i in range(len(self.tables))])
        owner = torch.repeat_interleave(torch.arange(len(self.tables)), lens)
        slots = table[owner, pos // bs].long() * bs + pos % bs
        out = HostTensors(torch.tensor(self.ids, dtype=torch.long), pos, slots,
                          torch.tensor(self.seq_lens, dtype=torch.int32), table)
        if pin:  # so every copy to the device is asynchronous
            out = HostTensors(*(x.pin_memory() for x in out))
        return out

    def metadata(self, t: HostTensors, block_size: int,
                 dev: torch.device) -> AttentionMetadata:
        nd = self.num_decodes
        return AttentionMetadata(
            slot_mapping=t.slots.to(dev, non_blocking=True),
            query_start_loc=to_device(self.qsl, torch.int32, dev),
            seq_lens=t.seq_lens.to(dev, non_blocking=True),
            block_tables=t.table.to(dev, non_blocking=True),
            num_decodes=nd,
            query_start_loc_cpu=self.qsl,
            seq_lens_cpu=self.seq_lens,
            max_seq_len=max(self.seq_lens),
            max_query_len=self.max_query_len,
            decode_max_seq_len=max(self.seq_lens[:nd], default=0),
            num_shared_blocks=count_shared_blocks(t.table, self.seq_lens[:nd], block_size),
            num_shared_prefill_blocks=shared_prefill_blocks(self, t.table, block_size),
        )


class HostTensors(NamedTuple):
    input_ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    seq_lens: torch.Tensor
    table: torch.Tensor  # [rows, widest row's blocks], padded with the null block


def shared_prefill_blocks(f: Forward, table: torch.Tensor, block_size: int) -> int:
    """Blocks shared by the cached prefixes of the prefill chunks that have at least one
    cached block (the others take the plain paths; see kernels/torch_attn.py)."""
    starts = [f.seq_lens[i] - (f.qsl[i + 1] - f.qsl[i]) for i in range(len(f.tables))]
    rows = [i for i in range(f.num_decodes, len(f.tables)) if starts[i] >= block_size]
    if len(rows) < 2:
        return 0
    return count_shared_blocks(table[rows], [starts[i] for i in rows], block_size)


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeroed memory. On CPU, numpy's calloc maps zero pages lazily instead of writing
    gigabytes up front. Zeros matter: padded attention reads unwritten slots with weight 0,
    and 0 * NaN garbage would be NaN."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    item = torch.empty((), dtype=dtype).element_size()
    raw = torch.from_numpy(np.zeros(shape[:-1] + (shape[-1] * item,), dtype=np.uint8))
    return raw.view(dtype)


def single_prefill_meta(n: int, block_size: int, device: torch.device) -> AttentionMetadata:
    """Metadata for one n-token prompt whose K/V all go to the null block (profiling only)."""
    return AttentionMetadata(
        slot_mapping=torch.zeros(n, dtype=torch.long, device=device),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
        block_tables=torch.zeros(1, -(-n // block_size), dtype=torch.int32, device=device),
        num_decodes=0, query_start_loc_cpu=[0, n], seq_lens_cpu=[n], max_seq_len=n,
        max_query_len=n, decode_max_seq_len=0,
    )

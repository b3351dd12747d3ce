"""One forward pass as rank 0 builds it and every tensor-parallel rank runs it, and the
attention metadata it becomes (kernels/metadata.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from baton.kernels.metadata import AttentionMetadata, count_shared_blocks

from ..lora.adapter import PROJECTIONS, LoRAAdapter
from .sampler import to_device
from .tp_wire import WireError, ints, ints_or_none


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

    def to_wire(self) -> dict:
        """As tp_wire carries it: plain values, each LoRA write's weights as tensors."""
        out = {f: getattr(self, f) for f in WIRE_FIELDS}
        out["lora_writes"] = [[slot, adapter.name, [[*key, a, b] for key, (a, b) in
                                                   adapter.weights.items()]]
                              for slot, adapter in self.lora_writes]
        return out

    @classmethod
    def from_wire(cls, d: dict) -> Forward:
        """The step `to_wire` gave, every field's type checked (WireError naming it)."""
        if set(d) != set(WIRE_FIELDS) | {"lora_writes"}:
            raise WireError("tensor-parallel step: fields "
                            f"{sorted(set(d) ^ (set(WIRE_FIELDS) | {'lora_writes'}))[:8]}")
        tables = d["tables"]
        if not isinstance(tables, list) or not tables:
            raise WireError("tensor-parallel step: tables must be a non-empty list")
        for name in ("num_decodes", "max_query_len"):
            if type(d[name]) is not int:
                raise WireError(f"tensor-parallel step: {name} must be an integer")
        if type(d["logits"]) is not bool:
            raise WireError("tensor-parallel step: logits must be true or false")
        return cls(ints(d["ids"], "ids"), ints(d["positions"], "positions"),
                   ints(d["qsl"], "qsl"), ints(d["seq_lens"], "seq_lens"),
                   [ints(t, "tables") for t in tables], d["num_decodes"],
                   d["max_query_len"], ints_or_none(d["rows"], "rows"), d["logits"],
                   ints_or_none(d["lora_tokens"], "lora_tokens"),
                   [_lora_write(w) for w in _list(d["lora_writes"], "lora_writes")])

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


WIRE_FIELDS = ("ids", "positions", "qsl", "seq_lens", "tables", "num_decodes",
               "max_query_len", "rows", "logits", "lora_tokens")


def _list(x, name: str) -> list:
    if not isinstance(x, list):
        raise WireError(f"tensor-parallel step: {name} must be a list")
    return x


def _lora_write(w) -> tuple[int, LoRAAdapter]:
    """[slot, name, [[layer, projection, part, A, B], ...]] -> (slot, the adapter)."""
    if not (isinstance(w, list) and len(w) == 3 and type(w[0]) is int
            and isinstance(w[1], str)):
        raise WireError("tensor-parallel step: a LoRA write must be [slot, name, weights]")
    weights = {}
    for entry in _list(w[2], "LoRA weights"):
        if not (isinstance(entry, list) and len(entry) == 5 and type(entry[0]) is int
                and entry[1] in PROJECTIONS and type(entry[2]) is int
                and all(isinstance(t, torch.Tensor) and t.dim() == 2 for t in entry[3:])):
            raise WireError("tensor-parallel step: a LoRA weight must be [layer, "
                            "projection, part, A, B]")
        weights[entry[0], entry[1], entry[2]] = (entry[3], entry[4])
    rank = max((a.shape[0] for a, _ in weights.values()), default=0)
    return w[0], LoRAAdapter(w[1], "", rank, weights)


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

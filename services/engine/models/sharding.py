"""Megatron's split of a decoder over tensor-parallel ranks, as each rank loads its part.

    column-parallel (each rank: a slice of the output rows; no communication)
        q_proj          heads  [r*Q/N, (r+1)*Q/N)
        k_proj, v_proj  the KV heads kv_layout.rank_heads gives the rank (replicated on
                        several ranks when there are fewer KV heads than ranks)
        gate_proj, up_proj   rows [r*I/N, (r+1)*I/N)
    row-parallel (each rank: the matching slice of the input columns; the partial sums
    meet in one all-reduce after the projection; the bias is added once, by rank 0)
        o_proj, down_proj
    vocab-parallel (each rank: ceil(V/N) rows of the vocabulary, the last padded with zeros)
        embed_tokens    a token's row is looked up on the rank that holds it, zeros
                        elsewhere, then all-reduced
        lm_head         each rank's logits for its rows, gathered on every rank

Norms, RoPE tables and the q/k norms are replicated. A LoRA adapter is split the way its
base projection is: B by rows for a column-parallel projection, A by columns for a
row-parallel one (its partial deltas are summed by the same all-reduce).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from baton.kernels.kv_layout import rank_heads

from ..model_config import ModelConfig

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")
# Our fused projections' parts, in order (LoRA: models/llama.py FUSED).
_PARTS = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj"),
          "o": ("o_proj",), "down": ("down_proj",)}


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of `size`, and the full model's config (what the slices are of)."""

    rank: int
    size: int
    full: ModelConfig

    @property
    def vocab_rows(self) -> int:
        """Rows of the vocabulary per rank (the last rank's padded past vocab_size)."""
        return -(-self.full.vocab_size // self.size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_rows

    def local_config(self) -> ModelConfig:
        """The config of this rank's part: its heads and MLP rows (vocab stays full)."""
        return shard_config(self.full, self.size, self.rank)

    def take(self, module: str, kind: str, w: torch.Tensor) -> torch.Tensor:
        """This rank's part of an HF tensor (`module` its last name, e.g. q_proj; `kind`
        weight or bias); a tensor outside the split comes back whole."""
        c, n, r = self.full, self.size, self.rank
        if n == 1:
            return w
        d = c.head_dim
        if module == "q_proj":
            per = c.num_heads // n * d
            return w.narrow(0, r * per, per)
        if module in ("k_proj", "v_proj"):
            heads = rank_heads(c.num_kv_heads, n, r)
            return w.narrow(0, heads.start * d, len(heads) * d)
        if module in ("gate_proj", "up_proj"):
            per = c.intermediate_size // n
            return w.narrow(0, r * per, per)
        if module in ROW:
            if kind == "bias":  # added once: by rank 0
                return w if r == 0 else torch.zeros_like(w)
            per = w.shape[1] // n
            return w.narrow(1, r * per, per)
        if module in ("embed_tokens", "lm_head"):
            rows = self.vocab_rows
            part = w[self.vocab_start:self.vocab_start + rows]
            if part.shape[0] < rows:
                part = torch.cat([part, part.new_zeros(rows - part.shape[0], *w.shape[1:])])
            return part
        return w

    def take_lora(self, proj: str, part: int, a: torch.Tensor,
                  b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (A [r, in], B [out, r]) of an adapter's part of a fused projection."""
        module = _PARTS[proj][part]
        if self.size == 1:
            return a, b
        if module in ROW:
            per = a.shape[1] // self.size
            return a.narrow(1, self.rank * per, per), b
        return a, self.take(module, "weight", b)


def shard_config(c: ModelConfig, size: int, rank: int = 0) -> ModelConfig:
    """`c` as one of `size` ranks holds it; ValueError naming what does not divide."""
    if size == 1:
        return c
    if c.num_heads % size:
        raise ValueError(f"tensor_parallel_size {size} must divide the model's "
                         f"{c.num_heads} attention heads")
    if c.intermediate_size % size:
        raise ValueError(f"tensor_parallel_size {size} must divide the model's MLP size "
                         f"{c.intermediate_size}")
    kv = rank_heads(c.num_kv_heads, size, rank)  # raises where neither divides
    return dataclasses.replace(c, num_heads=c.num_heads // size, num_kv_heads=len(kv),
                               intermediate_size=c.intermediate_size // size)

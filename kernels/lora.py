"""LoRA deltas for a batch that mixes adapters (punica's scheme): every token of the
flat batch carries the slot of its request's adapter, and each LoRA'd projection adds

    out[t] += B[s] @ (A[s] @ x[t])        s = slot[t]; no delta where slot[t] == -1

in one gathered "shrink" (x -> rank space) and one "expand" (rank space -> out), whatever
mix of adapters and base-model requests the step holds.

Weights of one projection, for every resident adapter at once (services/lora/slots.py):

    a  [slots, R, in]     R = parts * max_lora_rank: a fused projection (q|k|v, gate|up)
                          stacks each part's A; ranks below the maximum are zero rows
    b  [slots, out, R]    each part's B in its own rows and its own rank columns (block
                          diagonal), the scale alpha / r already folded in

Two paths, the same maths: `add_lora` (torch ops, any device: one pair of matmuls per
adapter present, over its tokens) and kernels/triton_lora.py (CUDA: one launch per shrink
and per expand for the whole batch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_RUNS = 4  # past this many runs of one adapter's tokens, one gathered index instead


@dataclass
class LoraBatch:
    """Which adapter each token of a step uses. Built once per step, read by every layer.

    token_slots: [num_tokens] int64 on the model's device, -1 for the base model.
    groups: (slot, rows) pairs for the torch path, in slot order: one slice per run of an
    adapter's consecutive tokens (the engine orders a step's requests by adapter, so an
    adapter's decodes are one run and its prompt chunks another), or, past MAX_RUNS runs,
    one index tensor (on the device) of all its rows. Base-model rows are in no group.
    """

    token_slots: torch.Tensor
    groups: list[tuple[int, slice | torch.Tensor]]

    @classmethod
    def of(cls, token_slots: list[int], device: torch.device) -> LoraBatch | None:
        """None when no token uses an adapter (the step runs as without LoRA)."""
        if not token_slots or max(token_slots) < 0:
            return None
        runs: dict[int, list[list[int]]] = {}  # slot -> [first, end) of each run
        for i, slot in enumerate(token_slots):
            if slot < 0:
                continue
            mine = runs.setdefault(slot, [])
            if mine and mine[-1][1] == i:
                mine[-1][1] = i + 1
            else:
                mine.append([i, i + 1])
        groups: list[tuple[int, slice | torch.Tensor]] = []
        for slot in sorted(runs):
            if len(runs[slot]) <= MAX_RUNS:
                groups += [(slot, slice(a, b)) for a, b in runs[slot]]
            else:
                rows = [i for a, b in runs[slot] for i in range(a, b)]
                groups.append((slot, torch.tensor(rows, dtype=torch.int64).to(device)))
        return cls(torch.tensor(token_slots, dtype=torch.int64).to(device), groups)


def add_lora(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             batch: LoraBatch) -> torch.Tensor:
    """out += each token's delta, in place (out [T, out_dim], x [T, in]); returns out."""
    for slot, rows in batch.groups:
        if isinstance(rows, slice):
            out[rows] += (x[rows] @ a[slot].T) @ b[slot].T
        else:
            out.index_add_(0, rows, (x.index_select(0, rows) @ a[slot].T) @ b[slot].T)
    return out


def reference(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
              token_slots: torch.Tensor) -> torch.Tensor:
    """Token by token, in fp32: what every path is tested against. Returns a new tensor."""
    res = out.float().clone()
    for t, slot in enumerate(token_slots.tolist()):
        if slot >= 0:
            res[t] += b[slot].float() @ (a[slot].float() @ x[t].float())
    return res.to(out.dtype)

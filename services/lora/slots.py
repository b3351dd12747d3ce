"""The adapters an engine holds, and the device slots a step's adapters sit in.

Host: every loaded adapter (adapter.py), at most `max_cpu_loras`, least recently used
dropped first (never one a live request runs). Device: `max_loras` slots, one weight
stack per layer and projection (the layout of kernels/lora.py):

    a[proj]  [max_loras, parts * max_rank, in]     part p's A in rows p*max_rank + [0, r)
    b[proj]  [max_loras, out, parts * max_rank]    part p's B in its rows of out and the
                                                   same columns; zeros elsewhere

A step's adapters (at most max_loras: the scheduler's rule) are put in slots before the
forward pass; a slot is reused least recently used first, never for an adapter of the
same step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from baton.kernels.lora import LoraBatch
from baton.kernels.lora import add_lora as torch_add_lora

from ..common.capacity import AtCapacity
from ..engine.model_config import ModelConfig
from .adapter import LoRAAdapter, projection_shapes

# (projection, part, A, B) -> this rank's (A, B).
Split = Callable[[str, int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class LayerLora:
    """A decoder layer's hook: `layer_lora(proj, x, out)` adds the step's deltas to a
    projection's output (no-op for a step without adapters)."""

    def __init__(self, slots: LoraSlots, layer: int):
        self.slots, self.layer = slots, layer

    def __call__(self, proj: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        s = self.slots
        if s.batch is None:
            return out
        a, b = s.a[proj][self.layer], s.b[proj][self.layer]
        return s.add(out, x, a, b, s.batch)


class LoraSlots:
    def __init__(self, c: ModelConfig, max_loras: int, max_rank: int, max_cpu_loras: int,
                 dtype: torch.dtype, device: torch.device, split: Split | None = None):
        """`c`: the model's config as this rank holds it; `split`: this tensor-parallel
        rank's part of an adapter's (A, B) for (projection, part) (models/sharding.py)."""
        self.split = split
        self.writes: list[tuple[int, LoRAAdapter]] = []  # slots filled, not yet written
        self.max_loras, self.max_rank, self.max_cpu_loras = max_loras, max_rank, max_cpu_loras
        self.shapes = projection_shapes(c)
        self.a: dict[str, list[torch.Tensor]] = {}
        self.b: dict[str, list[torch.Tensor]] = {}
        for proj, (in_size, outs) in self.shapes.items():
            width = len(outs) * max_rank
            self.a[proj] = [torch.zeros(max_loras, width, in_size, dtype=dtype, device=device)
                            for _ in range(c.num_layers)]
            self.b[proj] = [torch.zeros(max_loras, sum(outs), width, dtype=dtype,
                                        device=device) for _ in range(c.num_layers)]
        self.adapters: OrderedDict[str, LoRAAdapter] = OrderedDict()  # key -> it, LRU first
        self.slot_of: OrderedDict[str, int] = OrderedDict()  # on the device, LRU first
        self.batch: LoraBatch | None = None  # the step's, while it runs
        self.add: Callable = torch_add_lora
        if device.type == "cuda":
            from baton.kernels import triton_lora

            self.add = triton_lora.add_lora

    # ---- host --------------------------------------------------------------------

    def hold(self, adapter: LoRAAdapter, in_use: set[str | None]) -> None:
        """Keep an adapter under its key (replacing one of the same key); past
        max_cpu_loras, drop the least recently used one no live request runs, or refuse
        (AtCapacity: RESOURCE_EXHAUSTED, tried again later or on another worker)."""
        if adapter.key in self.adapters:
            self.drop(adapter.key)
        if len(self.adapters) >= self.max_cpu_loras:
            idle = next((n for n in self.adapters if n not in in_use), None)
            if idle is None:
                raise AtCapacity(f"{len(self.adapters)} LoRA adapters are held and every "
                                 "one is in use (raise --max-cpu-loras)")
            self.drop(idle)
        self.adapters[adapter.key] = adapter

    def drop(self, key: str) -> bool:
        """Forget an adapter; its slot is freed (zeroed when reused)."""
        self.slot_of.pop(key, None)
        return self.adapters.pop(key, None) is not None

    # ---- device: the step ---------------------------------------------------------

    def prepare(self, names: list[str | None]) -> list[int]:
        """Put the step's adapters (by key) in slots; each entry's slot (-1: the base
        model)."""
        wanted = {n for n in names if n is not None}
        assert len(wanted) <= self.max_loras, "the scheduler admits at most max_loras"
        for name in wanted:
            self.adapters.move_to_end(name)
            if name in self.slot_of:
                self.slot_of.move_to_end(name)
                continue
            taken = set(self.slot_of.values())
            free = next((s for s in range(self.max_loras) if s not in taken), None)
            if free is None:  # the least recently used slot not in this step
                victim = next(n for n in self.slot_of if n not in wanted)
                free = self.slot_of.pop(victim)
            self.writes.append((free, self.adapters[name]))
            self.slot_of[name] = free
        return [-1 if n is None else self.slot_of[n] for n in names]

    def take_writes(self) -> list[tuple[int, LoRAAdapter]]:
        """The slots `prepare` filled since the last call: (slot, adapter). Rank 0 sends
        them with the step; every rank then writes them (apply_writes)."""
        writes, self.writes = self.writes, []
        return writes

    def apply_writes(self, writes: list[tuple[int, LoRAAdapter]]) -> None:
        for slot, adapter in writes:
            self._write(slot, adapter)

    def _write(self, slot: int, adapter: LoRAAdapter) -> None:
        r = self.max_rank
        for proj, (_, outs) in self.shapes.items():
            for layer in range(len(self.a[proj])):
                a, b = self.a[proj][layer][slot], self.b[proj][layer][slot]
                a.zero_()
                b.zero_()
                row = 0
                for part, size in enumerate(outs):
                    w = adapter.weights.get((layer, proj, part))
                    if w is not None:
                        if self.split is not None:
                            w = self.split(proj, part, *w)
                        rank = w[0].shape[0]
                        a[part * r:part * r + rank].copy_(w[0])
                        b[row:row + size, part * r:part * r + rank].copy_(w[1])
                    row += size

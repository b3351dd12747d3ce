"""The tensor-parallel group: torch.distributed's own process group (gloo on CPU, NCCL on
GPU), met and proven at a rendezvous (tp_join.py), made as an object rather than torch's
process-wide default group, so one process may hold several engines (tests, offline runs)
and each its own group.

Rank 0 is the engine: it schedules, samples and sends every step's inputs (`send`, as
tp_wire.py's bytes: parsed, never unpickled); the other ranks (services/engine/
tp_ranks.py, `follow`) receive them (`recv`) and run the same forward pass on their slice
of the heads and the MLP. Inside the model the ranks
meet in `all_reduce` (after each row-parallel projection and the vocab-parallel
embedding) and `gather_vocab` (the LM head's logits, on rank 0).

A rank that dies closes its sockets: the others' next collective raises at once
(gloo: "Connection closed by peer"), never hangs. Idle ranks wait in `recv` without a
time limit that matters (`timeout`: days).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .tp_join import Rendezvous, join
from .tp_wire import WireError, decode, encode

# The largest message a rank takes (a step, or a LoRA adapter's weights with one).
MAX_MESSAGE_BYTES = 4 << 30


class RankDied(RuntimeError):
    """A tensor-parallel rank is gone: the worker cannot run another step."""


class TPGroup:
    def __init__(self, rendezvous: Rendezvous, rank: int, device: torch.device,
                 alive: Callable[[], None] = lambda: None):
        """Joins the group (tp_join.join: JoinError naming a rank that failed); `alive`
        raises while joining where a rank this process started is gone."""
        self.rank, self.size, self.device = rank, rendezvous.size, device
        self.dead: str | None = None  # set where a rank is known gone: nothing more runs
        self._on_death: list[Callable[[str], None]] = []
        # Why a rank is gone, where this process can tell (tp_ranks: a spawned rank's own
        # error), better than the collective's "connection closed"; None where it cannot.
        self.explain: Callable[[], str | None] = lambda: None
        self.store, self.pg = join(rendezvous, rank, device, alive)

    def on_death(self, fn: Callable[[str], None]) -> None:
        """Call `fn(why)` once a rank is known gone (now, if it is already)."""
        self._on_death.append(fn)
        if self.dead is not None:
            fn(self.dead)

    def died(self, why: str) -> None:
        if self.dead is not None:
            return
        self.dead = why
        for fn in self._on_death:
            fn(why)

    def _wait(self, work) -> None:
        try:
            work.wait()
        except RuntimeError as e:
            why = self.dead or self.explain() or f"a tensor-parallel rank is gone: {e}"
            self.died(why)
            raise RankDied(why) from e

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (x must be contiguous)."""
        self._wait(self.pg.allreduce([x]))
        return x

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Each rank's [T, V/size] slice of the vocabulary -> [T, vocab_size] on every rank,
        in rank order, the padding past vocab_size cut."""
        parts = [torch.empty_like(logits) for _ in range(self.size)]
        self._wait(self.pg.allgather([parts], [logits.contiguous()]))
        return torch.cat(parts, dim=-1)[..., :vocab_size]

    def send(self, kind: str, *args) -> None:
        """Rank 0: one message to every other rank (tp_wire.KINDS names them)."""
        if self.dead is not None:
            raise RankDied(self.dead)
        data = torch.frombuffer(bytearray(encode(kind, *args)), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.long)
        self._broadcast(size)
        self._broadcast(data)

    def recv(self) -> tuple[str, list]:
        """The next message from rank 0, parsed: (kind, args); WireError for bytes
        that are not one."""
        size = torch.zeros(1, dtype=torch.long)
        self._broadcast(size)
        if not 0 < int(size) <= MAX_MESSAGE_BYTES:
            raise WireError(f"a tensor-parallel message of {int(size)} bytes: "
                                    f"refused (at most {MAX_MESSAGE_BYTES})")
        data = torch.empty(int(size), dtype=torch.uint8)
        self._broadcast(data)
        return decode(data.numpy().data)

    def _broadcast(self, t: torch.Tensor) -> None:
        # Objects travel over the host even where the model runs on a GPU.
        if self.device.type == "cuda":
            dev = t.to(self.device)
            self._wait(self.pg.broadcast(dev, 0))
            t.copy_(dev.cpu())
        else:
            self._wait(self.pg.broadcast(t, 0))

    def gather_ints(self, value: int) -> list[int]:
        """Every rank's `value`, in rank order, on every rank."""
        parts = [torch.zeros(1, dtype=torch.long, device=self.device) for _ in range(self.size)]
        mine = torch.tensor([value], dtype=torch.long, device=self.device)
        self._wait(self.pg.allgather([parts], [mine]))
        return [int(p.item()) for p in parts]

    def min(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.long, device=self.device)
        self._wait(self.pg.allreduce([t], _min_opts()))
        return int(t.item())

    def barrier(self) -> None:
        self.all_reduce(torch.zeros(1, device=self.device))


def _min_opts():
    opts: Any = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MIN
    return opts

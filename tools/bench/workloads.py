"""The benchmark workloads (W1 to W4 and W6, docs/benchmarks.md): random-token prompts, greedy,
ignore_eos."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]
    output_len: int

    @property
    def num_output_tokens(self) -> int:
        return len(self.prompts) * self.output_len


def make_workload(name: str, vocab_size: int) -> Workload:
    """Prompts are ids from random.Random(seed) in [100, vocab_size - 1]."""
    name = name.lower()

    def ids(rng: random.Random, n: int) -> list[int]:
        return [rng.randint(100, vocab_size - 1) for _ in range(n)]

    if name == "w1":
        rng = random.Random(0)
        return Workload("W1", [ids(rng, rng.randint(64, 256)) for _ in range(64)], 128)
    if name == "w2":
        prefix = ids(random.Random(1), 1024)
        rng = random.Random(0)
        return Workload("W2", [prefix + ids(rng, 64) for _ in range(64)], 32)
    if name == "w3":
        rng = random.Random(0)
        return Workload("W3", [ids(rng, rng.randint(512, 1024)) for _ in range(32)], 16)
    if name == "w4":  # 16 tenants' prefixes; each request takes one, then its own tail
        prefixes = [ids(random.Random(100 + t), 1024) for t in range(16)]
        pick, tail = random.Random(4), random.Random(5)
        return Workload("W4", [prefixes[pick.randrange(16)] + ids(tail, 32)
                               for _ in range(256)], 32)
    if name == "w6":  # 48 tenants' prefixes, about 4x a 0.25 GiB pool: the KV tiers
        prefixes = [ids(random.Random(200 + t), 1024) for t in range(48)]
        pick, tail = random.Random(6), random.Random(7)
        return Workload("W6", [prefixes[pick.randrange(48)] + ids(tail, 32)
                               for _ in range(384)], 32)
    raise ValueError(f"unknown workload {name!r}; expected w1, w2, w3, w4 or w6")

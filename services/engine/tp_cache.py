"""Tensor-parallel KV caches in shared memory, so one process (rank 0's) sees every rank's.

Each rank's layer tensors lie in one file of its own, layer after layer:

    <dir>/<name>-r<rank>:  | layer 0 [blocks, K|V, rank's kv heads, bs, d] | layer 1 | ...

mapped MAP_SHARED by its rank and by rank 0. The file is created sparse (ftruncate), so
untouched blocks read zeros and cost no memory until written, as the one-rank cache's
calloc does. Rank 0 unlinks the names once every rank has mapped them: the memory lives
while a mapping does, and nothing is left behind when the processes end.
"""

from __future__ import annotations

import math
import os
import tempfile
import uuid

import torch

from baton.kernels import kv_layout

from .models.sharding import Shard


def new_name() -> str:
    return f"baton-kv-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _path(name: str, rank: int) -> str:
    root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(root, f"{name}-r{rank}")


def _map(path: str, shape: tuple[int, ...], dtype: torch.dtype, layers: int,
         create: bool) -> list[torch.Tensor]:
    item = torch.empty((), dtype=dtype).element_size()
    per_layer = math.prod(shape) * item
    if create:
        with open(path, "wb") as f:
            f.truncate(per_layer * layers)
    raw = torch.from_file(path, shared=True, size=per_layer * layers, dtype=torch.uint8)
    return [raw[i * per_layer:(i + 1) * per_layer].view(dtype).view(shape)
            for i in range(layers)]


def create(name: str, rank: int, shape: tuple[int, ...], dtype: torch.dtype,
           layers: int) -> list[torch.Tensor]:
    """This rank's caches, zeros, in a new shared file."""
    return _map(_path(name, rank), shape, dtype, layers, create=True)


def map_all(name: str, shard: Shard | None, num_blocks: int, block_size: int,
            dtype: torch.dtype) -> list[list[torch.Tensor]]:
    """Rank 0: every rank's caches, rank-major, from the files the ranks created."""
    assert shard is not None
    c = shard.full
    out = []
    for rank in range(shard.size):
        heads = len(kv_layout.rank_heads(c.num_kv_heads, shard.size, rank))
        shape = kv_layout.shape(num_blocks, heads, block_size, c.head_dim)
        out.append(_map(_path(name, rank), shape, dtype, c.num_layers, create=False))
    return out


def unlink_all(name: str, size: int) -> None:
    for rank in range(size):
        try:
            os.unlink(_path(name, rank))
        except FileNotFoundError:
            pass

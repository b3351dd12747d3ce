"""Tensor-parallel KV caches in shared memory, so one process (rank 0's) sees every rank's.

Each rank's layer tensors lie in one file of its own, layer after layer:

    <dir>/<name>-r<rank>:  | layer 0 [blocks, K|V, rank's kv heads, bs, d] | layer 1 | ...

mapped MAP_SHARED by its rank and by rank 0. Each rank creates its file itself, private
from birth: O_CREAT|O_EXCL|O_NOFOLLOW, mode 0600 (whatever the umask), so no other user
reads the KV through it, and a name someone made first (a file, a link) is refused, never
followed. Its whole size is reserved at once (posix_fallocate): a /dev/shm too small is
an error at start naming the size and path, not SIGBUS at a later KV write. Rank 0 opens
the other ranks' files likewise never through a link, and maps each only once it is this
user's regular file of the size expected. Rank 0 unlinks the names once every rank has
mapped them (every rank does, if the start fails): the memory lives while a mapping does,
and nothing is left behind when the processes end.
"""

from __future__ import annotations

import math
import os
import uuid

import torch

from baton.kernels import kv_layout

from .models.sharding import Shard
from .private_files import ForeignFile, open_own, shared_memory_dir


def new_name() -> str:
    return f"baton-kv-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _path(name: str, rank: int) -> str:
    return os.path.join(shared_memory_dir(), f"{name}-r{rank}")


def _create(path: str, size: int) -> int:
    """A new file of `size` bytes, reserved, only this user's; its descriptor."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(path, flags, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.posix_fallocate(fd, 0, size)
    except BaseException as e:
        os.close(fd)
        os.unlink(path)
        if isinstance(e, OSError):
            raise ValueError(f"cannot reserve {size} bytes ({size / 2**30:.2f} GiB) for a "
                             f"tensor-parallel rank's KV cache at {path}: {e.strerror}. The "
                             "folder must hold --kv-cache-gib for every rank (a container's "
                             "/dev/shm: Docker's --shm-size, or a Memory emptyDir)") from e
        raise
    return fd


def _open(path: str, size: int) -> int:
    """Another rank's file, checked: this user's, regular, private, `size` bytes."""
    try:
        fd, st = open_own(path, os.O_RDWR, private=True)
    except ForeignFile as e:
        raise ValueError(f"a tensor-parallel rank's KV cache file {path} {e.strerror}: "
                         "not mapped") from None
    if st.st_size != size:
        os.close(fd)
        raise ValueError(f"a tensor-parallel rank's KV cache file {path} holds "
                         f"{st.st_size} bytes, not {size}: not mapped")
    return fd


def _map(path: str, shape: tuple[int, ...], dtype: torch.dtype, layers: int,
         create: bool) -> list[torch.Tensor]:
    item = torch.empty((), dtype=dtype).element_size()
    per_layer = math.prod(shape) * item
    size = per_layer * layers
    fd = _create(path, size) if create else _open(path, size)
    try:
        # The file opened and checked above, whatever its name leads to by now.
        by_fd = f"/proc/self/fd/{fd}"
        raw = torch.from_file(by_fd if os.path.exists(by_fd) else path, shared=True,
                              size=size, dtype=torch.uint8)
    finally:
        os.close(fd)
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

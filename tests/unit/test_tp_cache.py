"""The tensor-parallel KV cache files (services/engine/tp_cache.py): private from birth
(0600, whatever the umask, before rank 0 unlinks them), created exclusively (a name that
is there first, a file or a link, is refused and never followed), their whole size
reserved at start (a full /dev/shm is a clear error then, not SIGBUS later), and mapped
by rank 0 only where they are this user's own files of the size expected."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from baton.services.engine import tp_cache
from baton.services.engine.model_config import ModelConfig
from baton.services.engine.models.sharding import Shard

MODEL = ModelConfig("LlamaForCausalLM", vocab_size=64, hidden_size=16, intermediate_size=32,
                    num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5,
                    max_position_embeddings=64, tie_word_embeddings=False, eos_token_ids=(0,))
BLOCKS, BLOCK_SIZE = 4, 16
SHAPE = (BLOCKS, 2, MODEL.num_kv_heads, BLOCK_SIZE, MODEL.head_dim)  # one rank's, size 1
SIZE = 3 * BLOCKS * 2 * 2 * BLOCK_SIZE * 8 * 4  # layers x ... x float32


@pytest.fixture
def name():
    """A fresh name, and every file under it gone afterwards, whatever the test did."""
    name = tp_cache.new_name()
    yield name
    tp_cache.unlink_all(name, 2)


@pytest.fixture
def umask_022():
    """The usual umask, which would leave a plain open() file readable by everyone."""
    old = os.umask(0o022)
    yield
    os.umask(old)


def _create(name: str, rank: int = 0) -> list[torch.Tensor]:
    return tp_cache.create(name, rank, SHAPE, torch.float32, MODEL.num_layers)


def test_a_cache_file_is_private_and_whole_from_its_creation(name, umask_022):
    caches = _create(name)
    st = os.stat(tp_cache._path(name, 0))  # still named: rank 0 has not unlinked it
    assert oct(st.st_mode & 0o777) == oct(0o600)
    assert st.st_size == SIZE
    assert st.st_blocks * 512 >= SIZE  # reserved, not sparse
    caches[1][2].fill_(3.0)
    mapped = tp_cache.map_all(name, Shard(0, 1, MODEL), BLOCKS, BLOCK_SIZE, torch.float32)
    assert torch.equal(mapped[0][1], caches[1])  # the same memory
    mapped[0][0][1].fill_(2.0)
    assert float(caches[0][1].mean()) == 2.0


@pytest.mark.parametrize("planted", ["file", "symlink"])
def test_a_name_that_is_there_first_is_refused_not_followed(name, tmp_path, planted):
    path = tp_cache._path(name, 0)
    victim = tmp_path / "victim" if planted == "symlink" else path
    with open(victim, "wb") as f:
        f.write(b"precious")
    os.chmod(victim, 0o600)
    if planted == "symlink":
        os.symlink(victim, path)
    with pytest.raises(FileExistsError):
        _create(name)
    with open(victim, "rb") as f:
        assert f.read() == b"precious"
    assert os.stat(victim).st_mode & 0o777 == 0o600


def test_a_full_shared_memory_is_a_clear_error_at_start(name, monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    path = tp_cache._path(name, 0)
    with pytest.raises(ValueError, match=f"cannot reserve {SIZE} bytes .* at {path}: "
                                         "No space left on device"):
        _create(name)
    assert not os.path.lexists(path)  # nothing left holding memory


@pytest.mark.parametrize("swap,words", [
    ("other owner", "owned by uid 12345"),
    ("symlink", "is a symbolic link"),
    ("shorter", f"holds {SIZE - 4096} bytes, not {SIZE}")])
def test_rank_0_maps_only_the_ranks_own_files(name, tmp_path, swap, words):
    _create(name, 0)
    path = tp_cache._path(name, 1)
    if swap == "symlink":
        elsewhere = tmp_path / "elsewhere"
        elsewhere.write_bytes(bytes(SIZE))
        os.symlink(elsewhere, path)
    else:
        _create(name, 1)
        if swap == "other owner":
            os.chown(path, 12345, 12345)
        else:
            os.truncate(path, SIZE - 4096)
    two = Shard(0, 2, MODEL)
    with pytest.raises(ValueError, match=words):
        tp_cache.map_all(name, two, BLOCKS * 2, BLOCK_SIZE, torch.float32)

"""The gRPC-stream fallback transport: whatever the chunking of the stream, the pulled
blocks land byte for byte where they were asked for, each message's blocks as it
arrives (a pull never sits in memory whole), and a stream of the wrong size fails."""

from __future__ import annotations

import time

import torch

from baton.kernels import kv_layout
from baton.kv_transfer.base import KVHandle, KVLayout, TransferState
from baton.kv_transfer.blocks import read_blocks
from baton.kv_transfer.grpc_stream import GrpcStreamReceiver

LAYOUT = KVLayout("m", "float32", block_size=4, num_layers=3, num_kv_heads=2, head_dim=8)
BLOCKS = 12


def _caches(seed: int | None) -> list[torch.Tensor]:
    shape = kv_layout.shape(BLOCKS, LAYOUT.num_kv_heads, LAYOUT.block_size, LAYOUT.head_dim)
    if seed is None:
        return [torch.zeros(shape) for _ in range(LAYOUT.num_layers)]
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(LAYOUT.num_layers)]


def _pull(receiver: GrpcStreamReceiver, remote: list[int], local: list[int]
          ) -> tuple[TransferState, str | None]:
    receiver.add_peer("p", LAYOUT, b"")
    receiver.start_load("t", KVHandle("p", "r", 1, tuple(remote), 0), remote, local)
    deadline = time.monotonic() + 60
    while not (result := receiver.poll("t"))[0].done:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    return result


def test_blocks_land_where_asked_whatever_the_chunking_each_as_it_arrives():
    source, dest = _caches(1), _caches(None)
    remote, local = [3, 7, 1, 9, 4], [2, 5, 11, 6, 8]
    data = read_blocks(source, remote)
    size = LAYOUT.block_bytes
    cuts = [0, size // 3, size + 5, 3 * size, len(data)]  # mid-block and whole-block cuts
    landed: list[list[int]] = []  # per message: which local blocks hold their bytes by then

    def fetch(handle, block_ids, heads):
        assert block_ids == remote and heads == range(LAYOUT.num_kv_heads)
        for a, b in zip(cuts, cuts[1:], strict=False):
            landed.append([d for d, r in zip(local, remote, strict=True)
                           if torch.equal(dest[0][d], source[0][r])])  # block d, layer 0
            yield data[a:b]

    receiver = GrpcStreamReceiver(LAYOUT, [dest], fetch)
    try:
        assert _pull(receiver, remote, local) == (TransferState.SUCCESS, None)
    finally:
        receiver.close()
    assert read_blocks(dest, local) == data
    others = [b for b in range(BLOCKS) if b not in local]
    assert not any(kv[others].any() for kv in dest)
    # Before the 4th message, the bytes of the first 3 blocks had arrived: in the cache.
    assert landed[3] == local[:3]


def test_a_stream_of_the_wrong_size_fails_the_pull():
    source = _caches(2)
    for extra in (b"", b"x" * 7, read_blocks(source, [1])):
        def fetch(handle, block_ids, heads, extra=extra):
            data = read_blocks(source, block_ids)
            yield data[:-5] if not extra else data + extra

        receiver = GrpcStreamReceiver(LAYOUT, [_caches(None)], fetch)
        try:
            state, error = _pull(receiver, [1, 2], [3, 4])
        finally:
            receiver.close()
        assert state == TransferState.FAILED and "ValueError" in error, error

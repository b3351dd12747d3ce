"""The paged KV cache's one layout (kernels/kv_layout.py), checked against the storage of
real tensors: a block of a layer is one contiguous run, K of every head then V; every
view the kernels take reads the element the offset function names; the cache writes land
inside the token's block; the block byte codec keeps its wire order; and a peer whose
layout has another name is refused, the field named."""

from __future__ import annotations

import pytest
import torch

from baton.kernels import kv_layout, reference, torch_attn
from baton.kv_transfer.base import IncompatibleLayout, KVLayout, check_caches
from baton.kv_transfer.blocks import read_blocks, write_blocks
from baton.services.worker.messages import layout_from_message, layout_message

BLOCKS, HEADS, BS, D = 5, 3, 4, 8
WHERE = dict(kv_heads=HEADS, block_size=BS, head_dim=D)


def _numbered() -> torch.Tensor:
    """A layer tensor whose every element holds its own index in storage."""
    shape = kv_layout.shape(BLOCKS, HEADS, BS, D)
    return torch.arange(BLOCKS * 2 * HEADS * BS * D, dtype=torch.float64).view(shape)


def test_a_block_of_a_layer_is_one_contiguous_run_k_of_every_head_then_v():
    cache = _numbered()
    run = kv_layout.block_elements(HEADS, BS, D)
    for b in range(BLOCKS):
        # In the order the layout states: K head 0..H-1, then V head 0..H-1, each [bs, d].
        order = [kv_layout.offset(b, kv, h, p, **WHERE) + x
                 for kv in (kv_layout.K, kv_layout.V) for h in range(HEADS)
                 for p in range(BS) for x in range(D)]
        assert order == list(range(b * run, (b + 1) * run))
        assert torch.equal(cache[b].reshape(-1), torch.tensor(order, dtype=torch.float64))


def test_every_view_reads_the_element_the_offset_names():
    cache = _numbered()
    heads_k, heads_v = kv_layout.head_views(cache)  # [kv_heads, blocks, bs, d]
    flash_k, flash_v = kv_layout.flash_views(cache)  # [blocks, bs, kv_heads, d]
    chunks = kv_layout.chunks(cache)  # [blocks * 2 * kv_heads, bs, d]
    assert heads_k.shape == (HEADS, BLOCKS, BS, D) and flash_k.shape == (BLOCKS, BS, HEADS, D)
    for view, kv in ((heads_k, kv_layout.K), (heads_v, kv_layout.V)):
        assert view.stride(-1) == 1 and view.data_ptr() == cache.data_ptr() + (
            kv_layout.offset(0, kv, 0, 0, **WHERE) * cache.element_size())
    for b in range(BLOCKS):
        for h in range(HEADS):
            for kv, heads, flash in ((kv_layout.K, heads_k, flash_k),
                                     (kv_layout.V, heads_v, flash_v)):
                first = kv_layout.offset(b, kv, h, 0, **WHERE)
                want = torch.arange(first, first + BS * D, dtype=torch.float64).view(BS, D)
                assert torch.equal(heads[h, b], want)
                assert torch.equal(flash[b, :, h], want)
                assert torch.equal(chunks[kv_layout.chunk(b, kv, h, HEADS)], want)


@pytest.mark.parametrize("write", [reference.reshape_and_cache, torch_attn.reshape_and_cache],
                         ids=["reference", "torch"])
def test_a_tokens_write_lands_inside_its_blocks_run(write):
    run = kv_layout.block_elements(HEADS, BS, D)
    for slot in (0, BS - 1, 2 * BS + 1, BLOCKS * BS - 1):
        cache = torch.zeros(kv_layout.shape(BLOCKS, HEADS, BS, D))
        key = torch.arange(1, HEADS * D + 1, dtype=torch.float32).view(1, HEADS, D)
        write(key, -key, cache, torch.tensor([slot]))
        written = cache.view(-1).nonzero().view(-1)
        block, pos = divmod(slot, BS)
        assert len(written) == 2 * HEADS * D
        assert block * run <= written.min() and written.max() < (block + 1) * run
        for h in range(HEADS):
            at = kv_layout.offset(block, kv_layout.K, h, pos, **WHERE)
            assert torch.equal(cache.view(-1)[at:at + D], key[0, h])
            at = kv_layout.offset(block, kv_layout.V, h, pos, **WHERE)
            assert torch.equal(cache.view(-1)[at:at + D], -key[0, h])


def test_the_wire_order_of_a_block_is_layer_then_k_v_then_head():
    torch.manual_seed(0)
    caches = [torch.randn(kv_layout.shape(BLOCKS, HEADS, BS, D)) for _ in range(2)]
    ids = [3, 0, 4]
    want = b"".join(view[h, b].contiguous().numpy().tobytes()
                    for b in ids for cache in caches
                    for view in kv_layout.head_views(cache) for h in range(HEADS))
    data = read_blocks(caches, ids)
    assert data == want
    dest = [torch.zeros_like(c) for c in caches]
    write_blocks(dest, [1, 2, 0], data)
    assert read_blocks(dest, [1, 2, 0]) == want and not any(c[[3, 4]].any() for c in dest)


def _layout(**change) -> KVLayout:
    fields = dict(model="m", dtype="float32", block_size=BS, num_layers=2, num_kv_heads=HEADS,
                  head_dim=D)
    return KVLayout(**{**fields, **change})


def test_the_layout_names_the_cache_order_and_a_peer_with_another_is_refused():
    ours = _layout()
    assert ours.cache_layout == kv_layout.NAME
    assert ours.layer_block_bytes == kv_layout.block_elements(HEADS, BS, D) * 4
    peer = _layout(cache_layout="head-major/v0")
    assert peer.fingerprint != ours.fingerprint
    with pytest.raises(IncompatibleLayout, match="cache_layout: ours 'block-major/v1', "
                                                  "peer 'head-major/v0'"):
        ours.check_compatible(peer)
    # Over the wire: the name goes both ways; a peer that sends none (one from before the
    # field) is refused the same way.
    assert layout_from_message(layout_message(ours)) == ours
    old = layout_message(ours)
    old.ClearField("cache_layout")
    with pytest.raises(IncompatibleLayout, match="cache_layout: ours 'block-major/v1', peer ''"):
        ours.check_compatible(layout_from_message(old))


def test_caches_in_another_shape_are_refused():
    layout = _layout()
    good = [torch.zeros(kv_layout.shape(BLOCKS, HEADS, BS, D)) for _ in range(2)]
    assert check_caches(layout, [good]) == BLOCKS
    head_major = [torch.zeros(2, HEADS, BLOCKS, BS, D) for _ in range(2)]
    with pytest.raises(ValueError, match="does not match"):
        check_caches(layout, [head_major])

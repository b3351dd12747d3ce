"""The head map between two tensor-parallel sizes (kv_transfer/head_map.py): every head a
local rank holds comes from the first peer rank that holds it, at the right offsets on
both sides, in as few runs as the heads allow; a split that cannot be made is refused at
the layout check, naming tp_size."""

from __future__ import annotations

from dataclasses import replace

import pytest

from baton.kernels import kv_layout
from baton.kv_transfer.base import IncompatibleLayout, KVLayout
from baton.kv_transfer.head_map import HeadRun, head_runs, rank_block_bytes, sources


def _layout(heads: int, tp: int, **change) -> KVLayout:
    return KVLayout("m", "float32", block_size=4, num_layers=2, num_kv_heads=heads,
                    head_dim=8, tp_size=tp, **change)


def _expected(heads: int, local_tp: int, peer_tp: int) -> list[tuple[int, int, int, int]]:
    """Per local head, from the definition: (local rank, its offset, peer rank, its
    offset), the peer rank being the first that holds the head."""
    out = []
    for rank in range(local_tp):
        for offset, h in enumerate(kv_layout.rank_heads(heads, local_tp, rank)):
            holders = [q for q in range(peer_tp) if h in kv_layout.rank_heads(heads, peer_tp, q)]
            peer = holders[0]
            out.append((rank, offset, peer, h - kv_layout.rank_heads(heads, peer_tp, peer).start))
    return out


def _per_head(runs: list[HeadRun]) -> list[tuple[int, int, int, int]]:
    return [(r.local_rank, r.local_head + i, r.remote_rank, r.remote_head + i)
            for r in runs for i in range(r.count)]


# (KV heads, prefill TP, decode TP): the decode worker maps its ranks onto the prefill's.
PAIRS = [(4, 1, 2), (4, 2, 1), (4, 2, 4), (4, 4, 2), (2, 4, 1), (2, 1, 4), (8, 2, 2),
         (2, 2, 4), (2, 4, 2), (2, 4, 4)]


@pytest.mark.parametrize("heads, prefill_tp, decode_tp", PAIRS)
def test_every_local_head_comes_from_its_first_holder_in_maximal_runs(heads, prefill_tp,
                                                                      decode_tp):
    runs = head_runs(_layout(heads, decode_tp), _layout(heads, prefill_tp))
    assert _per_head(runs) == _expected(heads, decode_tp, prefill_tp)
    for a, b in zip(runs, runs[1:], strict=False):  # no two runs could have been one
        assert not (a.local_rank == b.local_rank and a.remote_rank == b.remote_rank
                    and a.local_head + a.count == b.local_head
                    and a.remote_head + a.count == b.remote_head), (a, b)
    assert all(r.count > 0 for r in runs)


def test_the_documented_example_two_ranks_into_one():
    runs = head_runs(_layout(4, 1), _layout(4, 2))
    assert runs == [HeadRun(0, 0, 0, 0, 2), HeadRun(0, 2, 1, 0, 2)]
    # Replicated heads: 2 heads over 4 prefill ranks, each head's first holder.
    assert head_runs(_layout(2, 1), _layout(2, 4)) == [HeadRun(0, 0, 0, 0, 1),
                                                       HeadRun(0, 1, 2, 0, 1)]
    # One prefill rank into 4 decode ranks: each takes its one head.
    assert [(r.local_rank, r.remote_head) for r in head_runs(_layout(2, 4), _layout(2, 1))
            ] == [(0, 0), (1, 0), (2, 1), (3, 1)]


def test_equal_sizes_of_split_heads_map_each_rank_onto_itself_whole():
    for heads, tp in ((4, 1), (4, 2), (4, 4)):
        per_rank = len(kv_layout.rank_heads(heads, tp, 0))
        assert head_runs(_layout(heads, tp), _layout(heads, tp)) == [
            HeadRun(r, 0, r, 0, per_rank) for r in range(tp)]


@pytest.mark.parametrize("ours, peer, side", [(1, 2, "peer"), (2, 1, "ours"),
                                              (2, 2, "ours")])
def test_three_heads_over_two_ranks_are_refused_naming_tp_size(ours, peer, side):
    with pytest.raises(IncompatibleLayout, match=f"tp_size: {side} 2, 3 KV heads cannot"):
        head_runs(_layout(3, ours), _layout(3, peer))


def test_tp_size_alone_neither_refuses_a_peer_nor_changes_the_fingerprint():
    ours, peer = _layout(4, 1), _layout(4, 2)
    ours.check_compatible(peer)
    assert ours.fingerprint == peer.fingerprint
    # Another field still refuses, named, and tp_size is not blamed for it.
    with pytest.raises(IncompatibleLayout, match="dtype") as e:
        head_runs(ours, replace(peer, dtype="bfloat16"))
    assert "tp_size" not in str(e.value)


def test_sources_gather_a_head_range_from_the_ranks_that_hold_it():
    assert sources(4, 2, range(1, 3)) == [(0, 1, 1), (1, 0, 1)]
    assert sources(2, 4, range(2)) == [(0, 0, 1), (2, 0, 1)]
    assert sources(4, 1, range(4)) == [(0, 0, 4)]
    with pytest.raises(ValueError):
        sources(4, 2, range(3, 5))


def test_a_rank_pulls_its_heads_share_of_a_block():
    for heads, tp in ((4, 2), (2, 4), (4, 1)):
        layout = _layout(heads, tp)
        per_rank = len(kv_layout.rank_heads(heads, tp, 0))
        assert rank_block_bytes(layout, 0) * heads == layout.block_bytes * per_rank


def test_the_layout_message_carries_tp_size_and_a_peer_without_it_runs_one_rank():
    from baton.services.worker.messages import layout_from_message, layout_message

    ours = _layout(4, 2)
    assert layout_message(ours).tp_size == 2
    assert layout_from_message(layout_message(ours)) == ours
    old = layout_message(ours)
    old.ClearField("tp_size")  # a peer from before the field
    assert layout_from_message(old) == replace(ours, tp_size=1)


@pytest.mark.parametrize("tp", [2**40, 2**30, 0, -2])
def test_a_peers_tp_size_out_of_bounds_is_refused_before_any_rank_is_mapped(tp,
                                                                            monkeypatch):
    """A peer's tp_size would size a list of its ranks (head_map.sources): one past
    MAX_TP_SIZE is refused, naming it, before a single rank is looked at (rank_heads
    counted: one call per side would be the check; per rank, the allocation)."""
    calls, real = [0], kv_layout.rank_heads

    def counted(heads, tp_size, rank):
        calls[0] += 1
        if calls[0] > 1000:
            pytest.fail(f"rank_heads called per rank of tp_size {tp_size}: not bounded")
        return real(heads, tp_size, rank)

    monkeypatch.setattr(kv_layout, "rank_heads", counted)
    with pytest.raises(IncompatibleLayout, match=f"tp_size: peer {tp}, not in 1..1024"):
        head_runs(_layout(2, 1), _layout(2, tp))
    assert calls[0] <= 2
    with pytest.raises(IncompatibleLayout, match=f"tp_size: ours {tp}, not in 1..1024"):
        _layout(2, tp).check_compatible(_layout(2, 1))

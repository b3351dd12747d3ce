"""A NIXL peer's metadata (kv_transfer/nixl_metadata.py) is read only once every count in
it is bounded: a peer stating a huge pool, ranks or layers that its layout does not have,
addresses past 64 bits or a bad device is refused, naming what is wrong, and nothing is
built from it. What a connector writes, a receiver reads back as it was."""

from __future__ import annotations

import json
import tracemalloc
from dataclasses import replace

import pytest

from baton.kv_transfer.base import MAX_NUM_BLOCKS, IncompatibleLayout, KVLayout
from baton.kv_transfer.nixl_metadata import MAX_DESCRIPTORS, PeerMemory, encode, read

LAYOUT = KVLayout("m", "float32", block_size=4, num_layers=2, num_kv_heads=2, head_dim=8,
                  tp_size=2)
# One rank's layer block: 2 x 1 head x 4 x 8 floats.
LAYER_BLOCK = 2 * 1 * 4 * 8 * 4
MEMORY = PeerMemory(b"agent", [[4096, 8192], [12288, 16384]], 9, "DRAM", [0, 1])
PER_BLOCK = LAYOUT.tp_size * LAYOUT.num_layers


def _metadata(**change) -> bytes:
    md = json.loads(encode("peer-1", LAYOUT, MEMORY))
    md.update(change)
    return json.dumps(md).encode()


def test_what_a_connector_writes_is_read_back_as_it_was():
    assert read("peer-1", LAYOUT, _metadata(), PER_BLOCK) == MEMORY


@pytest.mark.parametrize("change, why", [
    ({"num_blocks": 2**40}, f"num_blocks 1099511627776 not in 1..{MAX_NUM_BLOCKS}"),
    ({"num_blocks": MAX_NUM_BLOCKS + 1}, "num_blocks 2147483649 not in"),
    ({"num_blocks": 0}, "num_blocks 0 not in"),
    ({"num_blocks": 9.0}, "num_blocks 9.0 not in"),
    ({"num_blocks": True}, "num_blocks True not in"),
    ({"num_blocks": MAX_NUM_BLOCKS}, "are more than NIXL indexes"),
    ({"tp_size": 2**40}, "metadata of 2 ranks, its layout has 2"),
    ({"base_addrs": [[4096, 8192]] * 4096}, "metadata of 4096 ranks"),
    ({"base_addrs": [[4096] * 4096, [8192, 0]]}, "a rank without 2 layers"),
    ({"base_addrs": [[4096, 2**64], [0, 0]]}, "rank 0's tensors of 9 blocks do not fit"),
    ({"base_addrs": [[0, 0], [2**64 - 9 * LAYER_BLOCK + 1, 0]]}, "rank 1's tensors"),
    ({"base_addrs": [[-1, 0], [0, 0]]}, "rank 0's tensors"),
    ({"base_addrs": [["4096", 0], [0, 0]]}, "rank 0's tensors"),
    ({"device_ids": [0] * 4096}, "device_ids must be 2 device indices"),
    ({"device_ids": [0, 2**40]}, "device_ids must be 2 device indices"),
    ({"mem_type": "HOST"}, "mem_type must be one of"),
    ({"version": 1}, "unknown metadata version 1"),
    ({"engine_id": "peer-2"}, "metadata of 'peer-2' given for peer peer-1"),
])
def test_a_count_out_of_bounds_is_refused_before_anything_is_built(change, why):
    raw = _metadata(**change)
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=why):
            read("peer-1", LAYOUT, raw, PER_BLOCK)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # Parsing the JSON costs what it costs; nothing is sized by a count in it.
    assert peak < 64 * len(raw) + (1 << 20), peak


def test_the_last_address_that_fits_and_the_most_descriptors_pass():
    top = 2**64 - 9 * LAYER_BLOCK
    assert read("peer-1", LAYOUT, _metadata(base_addrs=[[top, top], [top, 0]]),
                PER_BLOCK).base_addrs[0] == [top, top]
    blocks = MAX_DESCRIPTORS // PER_BLOCK
    assert read("peer-1", LAYOUT, _metadata(num_blocks=blocks, base_addrs=[[0, 0], [0, 0]]),
                PER_BLOCK).num_blocks == blocks


def test_metadata_for_another_layout_is_incompatible():
    with pytest.raises(IncompatibleLayout, match="another KV layout"):
        read("peer-1", replace(LAYOUT, head_dim=16), _metadata(), PER_BLOCK)

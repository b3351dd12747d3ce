"""The attention tests of tests/unit/test_kernels.py again, decode rows through the C++
kernel (kernels/cpu_decode.py) rather than the torch path it replaces where it builds: it
is built by a compiler, in a process of its own, so these run here and not in unit."""

from __future__ import annotations

import shutil

import pytest

from baton.kernels import cpu_decode
from tests.unit.test_kernels import (  # noqa: F401 (collected here with this decode_path)
    test_attention_bf16_close_to_fp32_reference,
    test_attention_matches_reference,
    test_cache_write_lands_in_the_right_slot,
    test_decodes_sharing_prefix_blocks_match_reference,
    test_prefill_chunks_after_a_shared_prefix_match_reference,
    test_reference_window_and_softcap_match_dense_attention,
    test_window_and_softcap_bf16_close_to_fp32_reference,
    test_window_and_softcap_match_reference,
    test_window_reads_only_the_blocks_it_touches,
)


@pytest.fixture(autouse=True)
def decode_path():
    if cpu_decode.load() is None:
        pytest.skip(f"the C++ decode kernel does not build here: {cpu_decode._failed}")
    return "c++ decode"


def test_the_cpu_decode_kernel_builds_where_there_is_a_compiler():
    if shutil.which("c++"):
        assert cpu_decode.load() is not None, cpu_decode._failed

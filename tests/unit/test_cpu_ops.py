"""How the CPU kernels' ISA is chosen and when a kernel serves (kernels/cpu_ops.py), without
building them (tests/integration/test_cpu_kernels.py builds and runs every ISA)."""

from __future__ import annotations

import pytest
import torch

from baton.kernels import cpu_ops


@pytest.mark.parametrize("flags,want", [
    (set(), ["portable"]),
    ({"avx2", "fma", "f16c"}, ["avx2", "portable"]),
    ({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"},
     ["avx512", "avx2", "portable"]),
    # AVX-512 BF16 without the rest of AVX-512's subsets is not enough for its build.
    ({"avx2", "fma", "f16c", "avx512f", "avx512_bf16"}, ["avx2", "portable"]),
    # ... nor without VNNI (the quantized weights' byte products).
    ({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"},
     ["avx512", "avx2", "portable"]),
    ({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16",
      "avx512_vnni"}, ["avx512_bf16", "avx512", "avx2", "portable"]),
])
def test_the_isas_a_cpu_runs_follow_its_flags_best_first(monkeypatch, flags, want):
    monkeypatch.setattr(cpu_ops, "cpu_flags", lambda: flags)
    assert cpu_ops.supported() == want


def test_an_isa_the_cpu_lacks_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(cpu_ops, "cpu_flags", lambda: {"avx2", "fma", "f16c"})
    monkeypatch.setenv("BATON_CPU_ISA", "avx512")
    with pytest.raises(ValueError, match="avx512.*runs \\['avx2', 'portable'\\]"):
        cpu_ops._initial()
    with pytest.raises(ValueError, match="avx512"):
        cpu_ops.set_isa("avx512")
    monkeypatch.setenv("BATON_CPU_ISA", "portable")
    assert cpu_ops._initial() == "portable"


def test_a_kernel_serves_only_on_cpu_where_it_measured_faster(monkeypatch):
    sentinel = object()
    monkeypatch.setattr(cpu_ops, "ops", lambda name=None: sentinel)
    with cpu_ops.using("portable"):
        assert cpu_ops.serves("decode", torch.device("cpu")) is None  # slower there
        with cpu_ops.using("portable", every_kernel=True):
            assert cpu_ops.serves("decode", torch.device("cpu")) is sentinel
            assert torch.float32 in cpu_ops.PREFILL_DTYPES
        # every_kernel is undone with the block
        assert cpu_ops.serves("decode", torch.device("cpu")) is None
        assert cpu_ops.PREFILL_DTYPES == {torch.bfloat16}
    native = cpu_ops.isa
    if native in cpu_ops.FASTER["rms_norm"]:
        assert cpu_ops.serves("rms_norm", torch.device("cpu")) is sentinel
    assert cpu_ops.serves("rms_norm", torch.device("meta")) is None


def test_kernels_turned_off_are_not_built_and_say_so(monkeypatch):
    monkeypatch.setenv("BATON_CPU_KERNELS", "0")
    monkeypatch.setattr(cpu_ops, "_built", {})
    assert cpu_ops.ops() is None
    assert cpu_ops.failure() == "BATON_CPU_KERNELS=0"
    assert "BATON_CPU_KERNELS=0" not in cpu_ops._failed.values()  # not kept past the switch

"""Batched multi-adapter LoRA: the torch path (kernels/lora.py add_lora) and the Triton path
(kernels/triton_lora.py) against the token-by-token fp32 reference. Without CUDA the Triton
kernels run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before
triton loads)."""

from __future__ import annotations

import os

import pytest
import torch

from baton.kernels import lora

triton_lora = pytest.importorskip(
    "baton.kernels.triton_lora", reason="triton is not installed: the Triton kernels are untested")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA and TRITON_INTERPRET is not 1: Triton cannot run the kernels",
                allow_module_level=True)

TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}

# Slot 1 is resident but unused; slot 0 comes in two runs (an index group), 2 and 3 in
# one run each (slices); rows 16..31 are all base-model tokens, as are the last ones.
MIXED = ([-1, -1, 0, 0, 0, 2, 2, 2, -1, 3, 3, 3, 3, 3, 3, -1] + [-1] * 16
         + [0, 0, 0, -1, -1, -1, -1])
# Decodes of different requests: most tiles hold several slots, in no order.
INTERLEAVED = [3, 0, -1, 2, 1, 0, 3, 3, -1, 1, 2, 0, 1, -1, 2, 3, 0, 1, 2, 3, -1, 0, 2]


def _check(token_slots, *, in_dim=72, out_dim=80, rank=24, num_slots=4,
           dtype=torch.float32, ranks=None, split_k=None, seed=0):
    """Both paths equal the reference within the dtype's rounding, and leave base-model
    rows bit for bit as they were. ranks: each slot's true rank, the rows of a beyond it
    zero (as a smaller adapter is padded to the maximum rank)."""
    gen = torch.Generator().manual_seed(seed)
    num_tokens = len(token_slots)
    x = torch.randn(num_tokens, in_dim, generator=gen)
    # Scaled so that y and the delta are about unit size, like out.
    a = torch.randn(num_slots, rank, in_dim, generator=gen) / in_dim**0.5
    b = torch.randn(num_slots, out_dim, rank, generator=gen) / rank**0.5
    if ranks is not None:
        for slot, slot_rank in enumerate(ranks):
            a[slot, slot_rank:] = 0.0
    out = torch.randn(num_tokens, out_dim, generator=gen)
    used = torch.tensor([s >= 0 for s in token_slots])
    base = ~used
    out[base, 0] = -0.0  # which base + 0.0 would turn to +0.0
    x, a, b, out = (t.to(dtype) for t in (x, a, b, out))

    want = lora.reference(out, x, a, b, torch.tensor(token_slots))
    # The deltas must stand far above the tolerance, or a kernel adding nothing would pass.
    assert (want[used].float() - out[used].float()).abs().amax(1).min() > 50 * TOL[dtype]

    got_torch = lora.add_lora(out.clone(), x, a, b, lora.LoraBatch.of(token_slots, "cpu"))
    dev_out = out.to(DEVICE)
    batch = lora.LoraBatch.of(token_slots, torch.device(DEVICE))
    ret = triton_lora.add_lora(dev_out, x.to(DEVICE), a.to(DEVICE), b.to(DEVICE), batch,
                               split_k=split_k)
    assert ret is dev_out  # in place
    for got in (got_torch, dev_out.cpu()):
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want.float(), rtol=TOL[dtype],
                                   atol=TOL[dtype])
        assert torch.equal(_bits(got[base]), _bits(out[base]))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def test_dims_are_not_tile_multiples():
    # The checks below mean something only if the default dims cut a tile short.
    assert 72 % triton_lora.BLOCK_K and 80 % triton_lora.BLOCK_N


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mixed_batch(dtype):
    _check(MIXED, dtype=dtype)


def test_interleaved_decodes():
    _check(INTERLEAVED)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_one_adapter(dtype):
    _check([2] * 40, dtype=dtype)


def test_single_token():
    _check([1], in_dim=40, out_dim=24, rank=8, num_slots=3)


def test_zero_padded_ranks():
    # Three fused parts of rank 16 (R = 48, padded to 64 in the kernels); slot 0 of rank 8.
    _check(INTERLEAVED, rank=48, ranks=(8, 48, 16, 32))
    _check(MIXED, rank=24, ranks=(24, 8, 16, 24), dtype=torch.bfloat16)


@pytest.mark.parametrize("in_dim, out_dim", [(96, 24), (40, 96), (33, 65)])
def test_other_dims(in_dim, out_dim):
    _check(MIXED, in_dim=in_dim, out_dim=out_dim, rank=16)


@pytest.mark.parametrize("split_k", [1, 2, 3])
def test_shrink_splits(split_k):
    # in_dim 72 is three BLOCK_K chunks: two splits share them unevenly.
    _check(INTERLEAVED, split_k=split_k)


def test_non_contiguous_input_is_refused():
    x = torch.randn(8, 4, device=DEVICE).T  # [4, 8], not contiguous
    a = torch.randn(2, 8, 8, device=DEVICE)
    b = torch.randn(2, 8, 8, device=DEVICE)
    out = torch.zeros(4, 8, device=DEVICE)
    batch = lora.LoraBatch.of([0, 1, 0, -1], torch.device(DEVICE))
    with pytest.raises(AssertionError, match="contiguous"):
        triton_lora.add_lora(out, x, a, b, batch)


def test_lora_batch_groups():
    assert lora.LoraBatch.of([-1, -1, -1], "cpu") is None
    assert lora.LoraBatch.of([], "cpu") is None
    batch = lora.LoraBatch.of(MIXED, "cpu")
    assert torch.equal(batch.token_slots, torch.tensor(MIXED))
    # Slot 0's two runs are two slices; the others one each.
    assert batch.groups == [(0, slice(2, 5)), (0, slice(32, 35)), (2, slice(5, 8)),
                            (3, slice(9, 15))]
    one = lora.LoraBatch.of([-1, 1, 1, 1], "cpu")
    assert one.groups == [(1, slice(1, 4))]
    # Past MAX_RUNS runs of one adapter: one gathered index of its rows.
    scattered = [1, -1] * (lora.MAX_RUNS + 1)
    (slot, rows), = lora.LoraBatch.of(scattered, "cpu").groups
    assert slot == 1 and torch.equal(rows, torch.arange(0, len(scattered), 2))

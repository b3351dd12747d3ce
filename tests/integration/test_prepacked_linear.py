"""oneDNN-prepacked linear weights (CPU, bf16) give the plain F.linear results and change
no greedy token. Not bit for bit: the two paths may pick different oneDNN kernels (on AMX
CPUs a bf16 matmul's low bits depend on the kernel), so the matmul is compared within
bf16's precision."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from baton.services.engine import SamplingParams
from baton.services.engine.models.layers import linear, prepack


@pytest.mark.skipif(prepack(torch.zeros(8, 8, dtype=torch.bfloat16)) is None,
                    reason="this torch build has no oneDNN linear packing")
def test_packed_weights_change_no_token(make_llm):
    llm = make_llm(dtype="bfloat16", max_num_seqs=4)
    model = llm.engine.runner.model
    assert all(layer.mlp.packed.get("down") is not None for layer in model.layers)
    x = torch.randn(5, 576, dtype=torch.bfloat16)
    w = model.layers[0].mlp.gate_up_weight
    want = F.linear(x, w)
    torch.testing.assert_close(linear(x, w, prepack(w)), want, rtol=1.6e-2, atol=1e-2)
    assert not torch.equal(linear(x, w.flip(0), prepack(w.flip(0))), want)  # it can fail
    prompts = [[100 + i for i in range(40)], [5000 + 3 * i for i in range(9)]]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    packed = [o.token_ids for o in llm.generate(prompts, params)]
    saved = [(layer.self_attn.packed, layer.mlp.packed) for layer in model.layers]
    lm_head = model.lm_head_packed
    try:
        for layer in model.layers:
            layer.self_attn.packed, layer.mlp.packed = {}, {}
        model.lm_head_packed = None
        llm.reset_prefix_cache()
        plain = [o.token_ids for o in llm.generate(prompts, params)]
    finally:
        for layer, (a, m) in zip(model.layers, saved, strict=True):
            layer.self_attn.packed, layer.mlp.packed = a, m
        model.lm_head_packed = lm_head
    assert packed == plain

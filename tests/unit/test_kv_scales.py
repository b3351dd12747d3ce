"""An fp8 KV cache's per-layer scales, read from a checkpoint's names as vLLM reads them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from baton.services.engine.models.kv_scales import kv_scale_of, set_kv_scale


@pytest.mark.parametrize("name,want", [
    ("model.layers.3.self_attn.k_scale", (3, ("k_scale",))),
    ("model.layers.0.self_attn.v_scale", (0, ("v_scale",))),
    ("model.layers.12.self_attn.kv_scale", (12, ("k_scale", "v_scale"))),
    ("model.layers.1.self_attn.k_proj.k_scale", (1, ("k_scale",))),
    ("model.layers.1.self_attn.v_proj.v_scale", (1, ("v_scale",))),
    ("model.layers.1.self_attn.k_proj.weight", None),
    ("model.layers.1.mlp.down_proj.weight_scale", None),
    ("lm_head.weight", None),
])
def test_which_names_are_kv_scales(name, want):
    assert kv_scale_of(name) == want


def test_a_scale_lands_on_the_layer_as_a_float_and_a_bad_one_is_refused():
    attn = SimpleNamespace(k_scale=1.0, v_scale=1.0)
    set_kv_scale(attn, ("k_scale", "v_scale"), "x.kv_scale", torch.tensor([0.03125]))
    assert (attn.k_scale, attn.v_scale) == (0.03125, 0.03125)
    set_kv_scale(attn, ("v_scale",), "x.v_scale", torch.tensor(2.0, dtype=torch.bfloat16))
    assert (attn.k_scale, attn.v_scale) == (0.03125, 2.0)
    for bad in (torch.tensor([1.0, 2.0]), torch.tensor(0.0), torch.tensor(float("inf"))):
        with pytest.raises(ValueError, match="x.k_scale"):
            set_kv_scale(attn, ("k_scale",), "x.k_scale", bad)

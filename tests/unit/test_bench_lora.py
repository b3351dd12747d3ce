"""tools/bench/lora.py: the random adapters it writes are ones the engine's loader takes,
with the shapes the model needs, and --loras parses or says what is wrong."""

import math

import pytest
import torch

from baton.services.engine.model_config import ModelConfig
from baton.services.lora.adapter import TARGETS, load_adapter, projection_shapes
from baton.tools.bench.lora import parse_counts, write_adapter

# Grouped-query attention, so q, k and v have different output sizes.
CONFIG = ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=32,
                     intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=8, rms_norm_eps=1e-5, max_position_embeddings=128,
                     tie_word_embeddings=False, eos_token_ids=(0,))


def test_written_adapter_loads_with_every_projection(tmp_path):
    path = write_adapter(str(tmp_path / "a"), CONFIG, rank=4, seed=0)
    adapter = load_adapter("a", path, CONFIG, max_rank=4, dtype=torch.float32)
    assert adapter.rank == 4
    shapes = projection_shapes(CONFIG)
    expected = {(layer, proj, part) for layer in range(2) for proj, part in TARGETS.values()}
    assert set(adapter.weights) == expected
    for (_, proj, part), (a, b) in adapter.weights.items():
        in_size, outs = shapes[proj]
        assert a.shape == (4, in_size) and b.shape == (outs[part], 4)
    # lora_alpha = 2r: the loader folds a scale of 2 into B, whose entries are ~0.01.
    b = adapter.weights[0, "down", 0][1]
    assert 0.01 < b.std().item() < 0.04
    a = adapter.weights[0, "qkv", 0][0]
    assert abs(a.std().item() - 1 / math.sqrt(32)) < 0.05


def test_seeds_give_different_adapters(tmp_path):
    one, two = (load_adapter(n, write_adapter(str(tmp_path / n), CONFIG, 2, seed), CONFIG,
                             2, torch.float32) for n, seed in (("x", 0), ("y", 1)))
    assert not torch.equal(one.weights[0, "o", 0][0], two.weights[0, "o", 0][0])


def test_rank_above_the_engine_maximum_is_refused(tmp_path):
    path = write_adapter(str(tmp_path / "big"), CONFIG, rank=8, seed=0)
    with pytest.raises(ValueError, match="rank 8 is above"):
        load_adapter("big", path, CONFIG, max_rank=4, dtype=torch.float32)


def test_parse_counts():
    assert parse_counts("0,1,4") == [0, 1, 4]
    for bad in ("", "0,x", "-1,2", "1,1"):
        with pytest.raises(ValueError, match="--loras"):
            parse_counts(bad)

"""Loading: GGUF dequantization against transformers' own GGUF reader, and an HF model
directory (llama3 RoPE scaling, GQA, untied embeddings) against HF's model."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from baton.services.engine import LLM, SamplingParams
from baton.services.engine.model_config import ModelConfig
from baton.services.engine.models.layers import rope_inv_freq


def test_gguf_weights_equal_transformers_gguf_reader(llm, hf_model):
    ours = llm.engine.runner.model
    ref = hf_model.state_dict()
    c = ours.config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    for i in (0, c.num_layers - 1):
        layer, pre = ours.layers[i], f"model.layers.{i}."
        qkv = layer.self_attn.qkv_weight
        assert torch.equal(qkv[:q], ref[pre + "self_attn.q_proj.weight"])
        assert torch.equal(qkv[q:q + kv], ref[pre + "self_attn.k_proj.weight"])
        assert torch.equal(qkv[q + kv:], ref[pre + "self_attn.v_proj.weight"])
        assert torch.equal(layer.self_attn.o_weight, ref[pre + "self_attn.o_proj.weight"])
        gate, up = layer.mlp.gate_up_weight.chunk(2)
        assert torch.equal(gate, ref[pre + "mlp.gate_proj.weight"])
        assert torch.equal(up, ref[pre + "mlp.up_proj.weight"])
        assert torch.equal(layer.mlp.down_weight, ref[pre + "mlp.down_proj.weight"])
        assert torch.equal(layer.input_layernorm.weight, ref[pre + "input_layernorm.weight"])
    assert torch.equal(ours.embed_tokens, ref["model.embed_tokens.weight"])
    assert torch.equal(ours.norm.weight, ref["model.norm.weight"])


def test_llama3_rope_matches_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}
    cfg = LlamaConfig(hidden_size=2048, num_attention_heads=16, max_position_embeddings=131072,
                      rope_parameters=rope)
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    got = rope_inv_freq(ModelConfig.from_hf(cfg).rope, 128)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    plain = rope_inv_freq(ModelConfig.from_hf(LlamaConfig(hidden_size=2048,
                                                          num_attention_heads=16)).rope, 128)
    assert not torch.allclose(plain, want)  # the scaling really changes something


def test_hf_directory_with_llama3_rope_matches_hf(tmp_path, llm):
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=llm.tokenizer.vocab_size, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=512, tie_word_embeddings=False, initializer_range=0.2,
        eos_token_id=2, bos_token_id=1,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64},
    )
    hf = LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path)
    llm.tokenizer.save_pretrained(tmp_path)
    tiny = LLM(model=str(tmp_path), dtype="float32", kv_cache_gib=0.01)
    prompts = [[5, 900, 17, 3000], list(range(100, 300))]  # the second passes position 64
    outs = tiny.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=False):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                              min_new_tokens=12, do_sample=False, pad_token_id=0)
        assert out.token_ids == ref[0, len(prompt):].tolist()
    tiny.engine.pool.check_all_free()


def test_a_missing_part_of_a_fused_weight_is_an_error(model_path):
    from baton.services.engine.loader import load_checkpoint
    from baton.services.engine.models.llama import LlamaForCausalLM

    config, weights = load_checkpoint(model_path)
    model = LlamaForCausalLM(config, 64, torch.float32, torch.device("cpu"), None)
    partial = ((n, w) for n, w in weights if n != "model.layers.3.self_attn.k_proj.weight")
    with pytest.raises(ValueError, match="layers.3.self_attn.qkv_weight"):
        model.load_weights(partial)


def test_dummy_load_format_fills_every_weight_from_a_config_alone(tmp_path, llm):
    """--load-format dummy: a directory with only config.json and a tokenizer serves, every
    parameter is filled (load_weights raises on any gap), and the seed fixes the weights."""
    cfg = LlamaConfig(vocab_size=llm.tokenizer.vocab_size, hidden_size=128,
                      intermediate_size=256, num_hidden_layers=3, num_attention_heads=8,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    cfg.save_pretrained(tmp_path)
    llm.tokenizer.save_pretrained(tmp_path)
    assert not list(tmp_path.glob("*.safetensors"))
    make = lambda seed: LLM(model=str(tmp_path), load_format="dummy", seed=seed,  # noqa: E731
                            dtype="float32", kv_cache_gib=0.01)
    a, b, c = make(3), make(3), make(4)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outs = [m.generate([[5, 900, 17]], params)[0].token_ids for m in (a, b)]
    assert len(outs[0]) == 6 and outs[0] == outs[1]
    wa, wc = (m.engine.runner.model.layers[2].mlp.down_weight for m in (a, c))
    assert wa.shape == (128, 256) and not torch.equal(wa, wc)
    assert 0.015 < wa.std().item() < 0.025

"""Tiny random-weight models of every family Baton serves, built from transformers'
own config and model classes (fixed seed), saved as HF directories with the default
model's tokenizer. No download: they are the references for greedy parity.

Each is small enough to generate with in a second, yet keeps what makes its family
different: a sliding window shorter than the test prompts, llama3 RoPE scaling past its
original context, q/k/v biases, q/k norms, a head_dim apart from hidden / heads,
Gemma's soft-caps and sandwich norms, tied and untied embeddings.
"""

from __future__ import annotations

import logging
from pathlib import Path

WINDOW = 24  # shorter than the test prompts, and not a multiple of the 16-token block
SHAPE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2,
             bos_token_id=1, eos_token_id=2, pad_token_id=0)


def family_configs(vocab_size: int) -> dict:
    """family -> a transformers config of a tiny model of it."""
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        Qwen2Config,
        Qwen3Config,
    )

    kw = dict(SHAPE, vocab_size=vocab_size)
    return {
        "llama": LlamaConfig(
            **kw, num_hidden_layers=2, head_dim=16, tie_word_embeddings=False,
            architectures=["LlamaForCausalLM"],
            rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 64}),
        "mistral": MistralConfig(**kw, num_hidden_layers=2, head_dim=16, sliding_window=WINDOW,
                                 tie_word_embeddings=False,
                                 architectures=["MistralForCausalLM"]),
        "qwen2": Qwen2Config(**kw, num_hidden_layers=2, tie_word_embeddings=True,
                             architectures=["Qwen2ForCausalLM"]),
        "qwen3": Qwen3Config(**kw, num_hidden_layers=2, head_dim=32, tie_word_embeddings=False,
                             architectures=["Qwen3ForCausalLM"]),
        "gemma2": Gemma2Config(**kw, num_hidden_layers=2, head_dim=32, query_pre_attn_scalar=24,
                               sliding_window=WINDOW, attn_logit_softcapping=5.0,
                               final_logit_softcapping=3.0,
                               architectures=["Gemma2ForCausalLM"]),
        "gemma3": Gemma3TextConfig(
            **kw, num_hidden_layers=3, head_dim=32, query_pre_attn_scalar=32,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                             "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                "rope_theta": 10000.0}},
            architectures=["Gemma3ForCausalLM"]),
    }


FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3")


def serving_config(vocab_size: int):
    """The tiny model the service tests run when what they check is the mechanics
    (routing, transfer, failures), not the model: a plain Llama with the default model's
    tokenizer and chat template, a long context, a few KB of KV per block, and a step
    that costs milliseconds."""
    from transformers import LlamaConfig

    return LlamaConfig(**dict(SHAPE, vocab_size=vocab_size, max_position_embeddings=4096),
                       num_hidden_layers=2, head_dim=16, tie_word_embeddings=False,
                       architectures=["LlamaForCausalLM"])


def build(family: str, folder: Path, tokenizer, seed: int = 0, cfg=None):
    """Save a tiny `family` model (and `tokenizer`) in `folder`; return the HF model, in
    fp32 with eager attention (the reference). `cfg`: another config than the family's."""
    import torch
    from transformers import AutoModelForCausalLM

    logging.getLogger("transformers").setLevel(logging.ERROR)
    cfg = cfg or family_configs(len(tokenizer))[family]
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    # HF starts norms at 1 (Gemma's (1 + w) at w = 0) and biases at 0, where a mix-up
    # would not show: vary them.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0 if family.startswith("gemma") else 1.0, 0.3)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.2)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


def hf_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    import torch

    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                             min_new_tokens=max_new, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def put_in_hub_cache(folder: Path, cache: Path, repo_id: str,
                     commit: str = "0123456789abcdef0123456789abcdef01234567") -> None:
    """Lay `folder` out in a huggingface_hub cache as `repo_id` at `commit` (branch main),
    as `snapshot_download` leaves it: then a hub id resolves offline, without a hub."""
    import shutil

    repo = cache / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)


# HF module -> llama.cpp tensor name, for the families Baton reads as GGUF.
_GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm"}


_GGUF_GEMMA_NAMES = {**_GGUF_NAMES, "pre_feedforward_layernorm": "ffn_norm",
                     "post_attention_layernorm": "post_attention_norm",
                     "post_feedforward_layernorm": "post_ffw_norm"}


def gguf_ready_config(family: str, vocab_size: int):
    """A tiny config whose every number a GGUF keeps or llama.cpp assumes: Gemma's
    query scale head_dim ** -0.5; Gemma 3's five windowed layers to one, local RoPE
    base 10000 (the GGUF has no key for them)."""
    cfg = family_configs(vocab_size)[family]
    if family.startswith("gemma"):
        cfg.query_pre_attn_scalar = cfg.head_dim
    if family == "gemma3":
        cfg.num_hidden_layers = 6
        cfg.layer_types = ["sliding_attention"] * 5 + ["full_attention"]
        cfg.rope_parameters["sliding_attention"]["rope_theta"] = 10000.0
    return cfg


def write_gguf(model, arch: str, path: Path, tokenizer, qtype: str | None = None) -> None:
    """An F32 GGUF of a tiny qwen2/qwen3/gemma2/gemma3 model as llama.cpp's converter
    lays it out: its tensor names and keys, q/k rows as HF has them (llama.cpp permutes
    them for its "llama" layout only), Gemma's norms stored as 1 + w. `qtype` ("Q4_0",
    "Q4_1", "Q8_0"): every matrix quantized to it by gguf's own quantizer."""
    import gguf
    import numpy as np

    c = model.config
    gemma = arch.startswith("gemma")
    names = _GGUF_GEMMA_NAMES if gemma else _GGUF_NAMES
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)
    w.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    if gemma:
        w.add_sliding_window(c.sliding_window)
        if c.attn_logit_softcapping:
            w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        if c.final_logit_softcapping:
            w.add_final_logit_softcapping(c.final_logit_softcapping)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_tokenizer_model("gpt2")
    # The model's vocabulary: the tokenizer's first c.vocab_size tokens (a smaller one
    # than the tokenizer's is read in a fraction of the time).
    w.add_token_list(tokenizer.convert_ids_to_tokens(list(range(c.vocab_size))))
    w.add_token_types([1] * c.vocab_size)
    w.add_token_merges([])
    w.add_eos_token_id(c.eos_token_id)
    w.add_bos_token_id(c.bos_token_id)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            name = f"blk.{i}.{names[module]}.{kind}"
        else:
            name = {"model.embed_tokens.weight": "token_embd.weight",
                    "model.norm.weight": "output_norm.weight",
                    "lm_head.weight": "output.weight"}[name]
        if gemma and name.endswith("norm.weight"):
            t = t + 1.0
        a = t.numpy().astype(np.float32)
        if qtype is not None and a.ndim == 2:
            kind = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(name, gguf.quants.quantize(a, kind), raw_dtype=kind)
        else:
            w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

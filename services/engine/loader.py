"""Load weights: a GGUF file (dequantized at load time) or an HF directory of safetensors.

Both produce HF-named tensors (`model.layers.0.self_attn.q_proj.weight`, ...) which the
model's `load_weights` consumes, behind a progress bar (tqdm on stderr; TQDM_DISABLE=1
hides it).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from ..common.model_source import resolve_model
from .gguf_cache import read_converted, write_through
from .model_config import ModelConfig

_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",  # qwen3, gemma3
    "attn_k_norm": "self_attn.k_norm",
}
# Gemma's sandwich norms: its ffn_norm is the norm before the MLP, not after attention.
_GGUF_GEMMA_NAMES = {**GGUF_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm",
                     "post_attention_norm": "post_attention_layernorm",
                     "post_ffw_norm": "post_feedforward_layernorm"}


def resolve_model_path(model: str | Path | None, revision: str | None = None) -> Path:
    """None means the default model; else a `.gguf` file, an HF directory or a hub id
    (services/common/model_source.py)."""
    return resolve_model(model, revision, check=_check_architecture)


def _check_architecture(config: dict) -> None:
    from .model_config import ARCHITECTURES, unsupported_architecture

    arch = (config.get("architectures") or [config.get("model_type")])[0]
    if arch not in ARCHITECTURES:
        raise unsupported_architecture(arch)


def _gguf_meta(reader) -> dict:
    meta = {}
    for key, field in reader.fields.items():
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges",
                   "tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            meta[key] = range(len(field.data))  # only the count is needed here
            continue
        meta[key] = field.contents()
    return meta


def _unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation.

    llama.cpp stores each head's rows as interleaved pairs (x0, y0, x1, y1, ...) for its
    GPT-J style RoPE; HF Llama rotates the two halves (x0..x_{d/2-1}, y0..y_{d/2-1}).
    Per head: rows [2, d/2] were swapped to [d/2, 2]; swap them back.
    """
    rows = w.shape[0]
    return (w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def gguf_row_order(part: str, rows: np.ndarray, c: ModelConfig) -> np.ndarray:
    """A GGUF tensor's rows (dequantized or raw blocks) in HF's order: only llama.cpp's
    "llama" layout permutes q/k rows (qwen's does not)."""
    if c.family in ("llama", "mistral") and part in ("attn_q", "attn_k"):
        return _unpermute_rope(rows, c.num_heads if part == "attn_q" else c.num_kv_heads)
    return rows


def load_gguf(path: Path) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor]]]:
    """The config and HF-named fp32 weights of a GGUF file: from its converted copy
    (gguf_cache.py) when there is one, else dequantized now and the copy written."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    cached = read_converted(path)
    if cached is not None:
        meta, has_output, tensors, count = cached
        return ModelConfig.from_gguf(meta, has_output), _progress(tensors, count, path.name)
    reader = GGUFReader(str(path))
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    meta = _gguf_meta(reader)
    config = ModelConfig.from_gguf(meta, has_output)
    gemma = config.family.startswith("gemma")
    layer_names = _GGUF_GEMMA_NAMES if gemma else GGUF_LAYER_NAMES

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for t in reader.tensors:
            w = dequantize(t.data, t.tensor_type)
            m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", t.name)
            if m:
                layer, part, kind = m.groups()
                if kind == "weight":
                    w = gguf_row_order(part, w, config)
                name = f"model.layers.{layer}.{layer_names[part]}.{kind}"
            elif t.name in _GGUF_NAMES:
                name = _GGUF_NAMES[t.name]
            else:
                continue  # e.g. rope_freqs: recomputed from the config
            w = torch.from_numpy(np.array(w, dtype=np.float32))
            if gemma and name.endswith("norm.weight"):
                w = w - 1.0  # llama.cpp stores Gemma's (1 + w) norms as 1 + w
            yield name, w

    tensors = write_through(path, meta, has_output, weights())
    return config, _progress(tensors, len(reader.tensors), path.name)


def load_hf_dir(path: Path) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor]]]:
    from safetensors import safe_open

    config = hf_dir_config(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no .safetensors files in model directory {str(path)!r}")
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})

    total = 0
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            total += len(sf.keys())

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for f in files:
            with safe_open(str(f), framework="pt") as sf:
                for name in sf.keys():
                    yield name, sf.get_tensor(name)

    return config, _progress(weights(), total, f"{path.name} ({len(files)} shards)")


def _progress(weights: Iterator[tuple[str, torch.Tensor]], total: int, what: str
              ) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors, with a progress bar on stderr while they load."""
    from tqdm import tqdm

    yield from tqdm(weights, total=total, desc=f"loading {what}", unit=" tensors",
                    mininterval=1.0, leave=False)


def hf_dir_config(path: Path) -> ModelConfig:
    from transformers import AutoConfig

    return ModelConfig.from_hf(AutoConfig.from_pretrained(str(path)))


def dummy_weights(c: ModelConfig, seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """Random weights under the checkpoint's names and shapes (vLLM's `--load-format
    dummy`): for measuring a model's shapes without its checkpoint, never its outputs.
    Matrices ~ N(0, 0.02^2), norms 1 (Gemma's (1 + w): w = 0), biases 0; the same seed
    gives the same weights."""
    g = torch.Generator().manual_seed(seed)

    def mat(rows: int, cols: int) -> torch.Tensor:
        return torch.empty(rows, cols).normal_(0.0, 0.02, generator=g)

    def norm(size: int) -> torch.Tensor:
        return torch.full((size,), 1.0 - c.norm_offset)

    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    norms = ["input_layernorm", "post_attention_layernorm"]
    if c.sandwich_norms:
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    yield "model.embed_tokens.weight", mat(c.vocab_size, c.hidden_size)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        for name in norms:
            yield p + f"{name}.weight", norm(c.hidden_size)
        if c.qk_norm:
            yield p + "self_attn.q_norm.weight", norm(c.head_dim)
            yield p + "self_attn.k_norm.weight", norm(c.head_dim)
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            yield p + f"self_attn.{name}.weight", mat(rows, c.hidden_size)
            if c.qkv_bias:
                yield p + f"self_attn.{name}.bias", torch.zeros(rows)
        yield p + "self_attn.o_proj.weight", mat(c.hidden_size, q)
        if c.o_bias:
            yield p + "self_attn.o_proj.bias", torch.zeros(c.hidden_size)
        for name, rows, cols in (("gate_proj", c.intermediate_size, c.hidden_size),
                                 ("up_proj", c.intermediate_size, c.hidden_size),
                                 ("down_proj", c.hidden_size, c.intermediate_size)):
            yield p + f"mlp.{name}.weight", mat(rows, cols)
            if c.mlp_bias:
                yield p + f"mlp.{name}.bias", torch.zeros(rows)
    yield "model.norm.weight", norm(c.hidden_size)
    if not c.tie_word_embeddings:
        yield "lm_head.weight", mat(c.vocab_size, c.hidden_size)


def load_checkpoint(path: Path, load_format: str = "auto", seed: int = 0,
                    ) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor]]]:
    """(config, HF-named weights). load_format "dummy": the config only (an HF directory's
    config.json), with random weights."""
    if load_format == "dummy":
        if path.suffix == ".gguf":
            config, _ = load_gguf(path)
        else:
            config = hf_dir_config(path)
        return config, dummy_weights(config, seed)
    return load_gguf(path) if path.suffix == ".gguf" else load_hf_dir(path)

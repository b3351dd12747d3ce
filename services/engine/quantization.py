"""`--quantization` (vLLM's flag): which linear weights stay quantized in memory.

    None   every weight in the model dtype (a GGUF is dequantized at load)
    int8   every linear weight (the LM head included) int8 per output channel, its scales
           computed at load from the loaded weights (any bf16/fp32 checkpoint, or a GGUF);
           weight-only: activations stay in the model dtype
    w8a8   the same weights, bf16/fp16 activations quantized to int8 as they meet them
           (per token for oneDNN's int8 matmul, per 32 columns for the integer kernel)
    gguf   a GGUF's Q4_0, Q4_1 and Q8_0 weights as the file holds them (the token
           embedding too, which a tied LM head shares); a linear whose parts are of another
           type stays in the model dtype

The quantized weights replace the dense ones (freed); norms, biases and RoPE stay in the
model dtype. How they multiply: kernels/quant.py.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from torch import nn

from baton.kernels import quant

from .config import check_quantization as check
from .model_config import ModelConfig

log = logging.getLogger(__name__)

_GGUF_TYPES = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1"}


def linears(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """Every linear of a model: its key ("layers.3.qkv", ..., "lm_head") -> (the module
    that holds it, its name there)."""
    out: dict[str, tuple[nn.Module, str]] = {}
    for i, layer in enumerate(model.decoder_layers):  # type: ignore[attr-defined]
        for name in ("qkv", "o"):
            out[f"layers.{i}.{name}"] = (layer.self_attn, name)
        for name in ("gate_up", "down"):
            out[f"layers.{i}.{name}"] = (layer.mlp, name)
    out["lm_head"] = (model, "lm_head")
    return out


def _dense(module: nn.Module, name: str) -> torch.Tensor:
    return getattr(module, "lm_head" if name == "lm_head" else f"{name}_weight")


def _install(model: nn.Module, key: str, w: quant.QuantWeight) -> None:
    """Serve linear `key` from `w` and free its dense weight."""
    module, name = linears(model)[key]
    dense = _dense(module, name)
    if (w.n, w.k) != tuple(dense.shape):
        raise ValueError(f"{key}: quantized {(w.n, w.k)} != {tuple(dense.shape)}")
    w.data, w.scale = w.data.to(dense.device), None if w.scale is None else w.scale.to(
        dense.device)
    if name == "lm_head":
        model.lm_head_packed = w  # type: ignore[assignment]
    else:
        module.packed[name] = w  # type: ignore[index, operator]
    if not (name == "lm_head" and model.config.tie_word_embeddings):  # type: ignore
        dense.data = dense.data.new_empty(0)  # a tied head is the embedding: kept below


def apply(model: nn.Module, method: str | None, checkpoint: Path) -> None:
    """Quantize `model`'s linears as `method` says; call after load_weights."""
    check(method)
    if method is None:
        return
    if method in ("int8", "w8a8"):
        with torch.no_grad():
            for key, (module, name) in linears(model).items():
                _install(model, key, quant.quantize_int8(_dense(module, name),
                                                         act_int8=method == "w8a8"))
        head = model.lm_head_packed  # type: ignore[attr-defined]
    else:
        if checkpoint.suffix != ".gguf":
            raise ValueError(f"quantization 'gguf' needs a .gguf checkpoint, not {checkpoint}")
        found, embed = gguf_weights(checkpoint, model.config)  # type: ignore[arg-type]
        for key, w in found.items():
            _install(model, key, w)
        head = embed
    # The embedding: rows dequantized as they are looked up, when its bytes are kept
    # quantized (a tied head's int8 copy, or the GGUF's own token embedding).
    c: ModelConfig = model.config  # type: ignore[assignment]
    if head is not None and (method == "gguf" or c.tie_word_embeddings):
        model.embed_quant = head  # type: ignore[assignment]
        model.embed_tokens.data = model.embed_tokens.data.new_empty(0)  # type: ignore


def stored_bytes(model: nn.Module) -> int:
    """Bytes of the weights as stored, each tensor once (a tied head and its embedding
    too): the parameters (a dense weight replaced by a quantized one is empty) and the
    quantized weights. Also what a decode step reads, but for the embedding's rows."""
    tensors = list(model.parameters())
    for m in model.modules():
        for w in [*getattr(m, "packed", {}).values(), getattr(m, "lm_head_packed", None),
                  getattr(m, "embed_quant", None)]:
            if isinstance(w, quant.QuantWeight):
                tensors += [w.data] + ([] if w.scale is None else [w.scale])
    seen, total = set(), 0
    for t in tensors:
        if t.numel() and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def gguf_weights(path: Path, c: ModelConfig
                 ) -> tuple[dict[str, quant.QuantWeight], quant.QuantWeight | None]:
    """The linears of a GGUF whose every part is Q4_0, Q4_1 or Q8_0 (q/k/v and gate/up
    fused, q/k rows un-permuted as the loader does), and its token embedding if quantized."""
    from gguf import GGUFReader

    from .loader import _unpermute_rope

    reader = GGUFReader(str(path))
    permuted = c.family in ("llama", "mistral")
    parts: dict[str, quant.QuantWeight | None] = {}
    seen: Counter[str] = Counter()
    for t in reader.tensors:
        fmt = _GGUF_TYPES.get(t.tensor_type.name)
        m = re.fullmatch(r"blk\.(\d+)\.(attn_[qkv]|attn_output|ffn_gate|ffn_up|ffn_down)"
                         r"\.weight", t.name)
        name = f"{m.group(1)}.{m.group(2)}" if m else {
            "output.weight": "output", "token_embd.weight": "embed"}.get(t.name)
        if name is None:
            continue
        seen[t.tensor_type.name] += 1
        if fmt is None:
            parts[name] = None
            continue
        rows = np.array(t.data)
        if permuted and m and m.group(2) in ("attn_q", "attn_k"):
            rows = _unpermute_rope(rows, c.num_heads if m.group(2) == "attn_q"
                                   else c.num_kv_heads)
        # Activations may meet GGUF weights quantized per block, as llama.cpp's do.
        parts[name] = quant.from_gguf(fmt, torch.from_numpy(np.ascontiguousarray(rows)),
                                      int(t.shape[0]), act_int8=True)
    fused = {"qkv": ("attn_q", "attn_k", "attn_v"), "o": ("attn_output",),
             "gate_up": ("ffn_gate", "ffn_up"), "down": ("ffn_down",)}
    out: dict[str, quant.QuantWeight] = {}
    for i in range(c.num_layers):
        for key, names in fused.items():
            got = [parts.get(f"{i}.{n}") for n in names]
            if all(g is not None for g in got) and len({g.fmt for g in got}) == 1:  # type: ignore
                out[f"layers.{i}.{key}"] = quant.concat(got)  # type: ignore[arg-type]
    embed = parts.get("embed")
    head = parts.get("output") if "output" in parts else (
        embed if c.tie_word_embeddings else None)
    if head is not None:
        out["lm_head"] = head
    dense = 4 * c.num_layers + 1 - len(out)
    log.info("GGUF %s: tensor types %s; %d linears kept quantized, %d dequantized",
             path.name, dict(seen), len(out), dense)
    return out, embed


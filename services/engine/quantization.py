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


def _install(model: nn.Module, module: nn.Module, name: str, w: quant.QuantWeight) -> None:
    """Serve linear `name` of `module` from `w` and free its dense weight."""
    dense = _dense(module, name)
    if (w.n, w.k) != tuple(dense.shape):
        raise ValueError(f"{name}: quantized {(w.n, w.k)} != {tuple(dense.shape)}")
    w.data, w.scale = w.data.to(dense.device), None if w.scale is None else w.scale.to(
        dense.device)
    if name == "lm_head":
        model.lm_head_packed = w  # type: ignore[assignment]
    else:
        module.packed[name] = w  # type: ignore[index, operator]
    if not (name == "lm_head" and model.config.tie_word_embeddings):  # type: ignore
        dense.data = dense.data.new_empty(0)  # a tied head is the embedding: kept below


def apply(model: nn.Module, method: str | None, checkpoint: Path) -> None:
    """Quantize `model`'s linears as `method` (EngineConfig checked it) says; call after
    load_weights."""
    if method is None:
        return
    every = linears(model)
    if method in ("int8", "w8a8"):
        with torch.no_grad():
            for module, name in every.values():
                _install(model, module, name, quant.quantize_int8(
                    _dense(module, name), act_int8=method == "w8a8"))
        head = model.lm_head_packed  # type: ignore[attr-defined]
    else:
        if checkpoint.suffix != ".gguf":
            raise ValueError(f"quantization 'gguf' needs a .gguf checkpoint, not {checkpoint}")
        found, embed = gguf_weights(checkpoint, model.config)  # type: ignore[arg-type]
        for key, w in found.items():
            _install(model, *every[key], w)
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
    fused as the model fuses them, rows in HF's order as the loader puts them), and its
    token embedding if quantized."""
    from gguf import GGUFReader

    from .loader import GGUF_LAYER_NAMES, gguf_row_order
    from .models.llama import FUSED

    # key ("layers.3.qkv", "lm_head", "embed") -> its parts in row order (None: a part of
    # a type not served quantized).
    parts: dict[str, dict[int, quant.QuantWeight | None]] = {}
    seen: Counter[str] = Counter()
    for t in GGUFReader(str(path)).tensors:
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", t.name)
        if m:
            fused = FUSED.get(GGUF_LAYER_NAMES.get(m.group(2), ""))
            if fused is None:
                continue  # a norm
            key, index = f"layers.{m.group(1)}.{fused[0].split('.')[1]}", fused[1]
        elif t.name in ("output.weight", "token_embd.weight"):
            key, index = ("lm_head" if t.name == "output.weight" else "embed"), 0
        else:
            continue
        seen[t.tensor_type.name] += 1
        fmt = _GGUF_TYPES.get(t.tensor_type.name)
        rows = gguf_row_order(m.group(2), np.array(t.data), c) if m and fmt else None
        # Activations may meet GGUF weights quantized per block, as llama.cpp's do.
        parts.setdefault(key, {})[index] = None if fmt is None else quant.from_gguf(
            fmt, torch.from_numpy(np.ascontiguousarray(rows if m else t.data)),
            int(t.shape[0]), act_int8=True)
    out: dict[str, quant.QuantWeight] = {}
    for key, got in parts.items():
        ws = [got[i] for i in sorted(got)]
        if all(w is not None for w in ws) and len({w.fmt for w in ws}) == 1:  # type: ignore
            out[key] = quant.concat(ws)  # type: ignore[arg-type]
    embed = out.pop("embed", None)
    if "lm_head" not in parts and embed is not None and c.tie_word_embeddings:
        out["lm_head"] = embed
    log.info("GGUF %s: tensor types %s; %d linears kept quantized, %d dequantized",
             path.name, dict(seen), len(out), 4 * c.num_layers + 1 - len(out))
    return out, embed

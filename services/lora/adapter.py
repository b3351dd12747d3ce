"""LoRA adapters from PEFT directories: read, checked against the model, kept on the host
until a step needs one on the device (slots.py).

A PEFT directory holds `adapter_config.json` (r, lora_alpha, target_modules, ...) and
`adapter_model.safetensors` (or `.bin`) with, per adapted module (q, k, v, o, gate, up,
down), two tensors named after it:

    base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight    A [r, in]
    base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight    B [out, r]

and the module computes W x + scale * B (A x), scale = lora_alpha / r (lora_alpha /
sqrt(r) with use_rslora). Here every target maps to a part of one of our fused
projections (q|k|v, o, gate|up, down); the scale is folded into B once, at load.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field

import torch

from ..engine.model_config import ModelConfig
from .names import check_name, shown
from .paths import Unreadable, beneath

# HF module -> (our fused projection, which part of it).
TARGETS = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2),
           "o_proj": ("o", 0), "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1),
           "down_proj": ("down", 0)}
PROJECTIONS = frozenset(proj for proj, _ in TARGETS.values())
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])"
                  r"(?:\.[\w-]+)?\.weight$")


@dataclass(frozen=True)
class LoRARequest:
    """Which adapter a request runs, in vLLM's form: `lora_path` is its PEFT directory,
    read on first use where the engine does not hold it yet. Adapters are known by name
    here: `lora_int_id` is taken for vLLM's callers and not used."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""
    sent: bool = False  # lora_path came from a caller (a worker's request), not the operator


def projection_shapes(c: ModelConfig) -> dict[str, tuple[int, list[int]]]:
    """Our fused projection -> (its input size, the output size of each part)."""
    q, kv, inter, h = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, \
        c.intermediate_size, c.hidden_size
    return {"qkv": (h, [q, kv, kv]), "o": (q, [h]), "gate_up": (h, [inter, inter]),
            "down": (inter, [h])}


@dataclass
class LoRAAdapter:
    """One adapter on the host: per (layer, fused projection, part), A [r, in] and
    scale * B [out, r], in the model's dtype."""

    name: str
    path: str
    rank: int  # the largest of its modules'
    weights: dict[tuple[int, str, int], tuple[torch.Tensor, torch.Tensor]] = \
        field(default_factory=dict)
    fingerprint: str = ""  # sha256 of the weights as served (scale folded in)
    key: str = ""  # what the engine holds it under (registry.py): its binding
    sent: bool = False  # read from a path a caller sent (paths.py), not the operator's

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def load_adapter(name: str, path: str, c: ModelConfig, max_rank: int,
                 dtype: torch.dtype, root: str | None = None) -> LoRAAdapter:
    """Read and check a PEFT LoRA directory; ValueError, saying why, on anything this model
    cannot apply exactly, and its subclass Unreadable (paths.py) where a file is
    absent or does not open, or (with `root`) resolves outside `root`."""
    check_name(name)
    config = _read_config(name, path, root)
    for key, bad in (("use_dora", True), ("fan_in_fan_out", True)):
        if config.get(key) == bad:
            raise ValueError(f"LoRA adapter {name!r}: {key} is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {name!r}: bias {config['bias']!r} is not supported "
                         "(only 'none')")
    for key in ("modules_to_save", "alpha_pattern"):
        if config.get(key):
            raise ValueError(f"LoRA adapter {name!r}: {key} is not supported")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        lacking = sorted(set(targets) - set(TARGETS))
        if lacking:
            raise ValueError(f"LoRA adapter {name!r} targets {lacking}, which "
                             f"{c.architecture} does not have as LoRA targets (it has "
                             f"{sorted(TARGETS)})")
    alpha = config.get("lora_alpha", config.get("r"))
    if not isinstance(alpha, (int, float)):
        raise ValueError(f"LoRA adapter {name!r}: adapter_config.json has no lora_alpha")
    pairs = _pairs(name, _read_weights(name, path, root), c)
    shapes = projection_shapes(c)
    adapter = LoRAAdapter(name, path, 0)
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {name!r}: layer {layer} {module} has lora_"
                             f"{''.join(ab)} without its pair")
        a, b = ab["A"], ab["B"]
        proj, part = TARGETS[module]
        in_size, outs = shapes[proj]
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != r or a.shape[1] != in_size \
                or b.shape[0] != outs[part]:
            raise ValueError(f"LoRA adapter {name!r}: layer {layer} {module} has A "
                             f"{tuple(a.shape)} and B {tuple(b.shape)}; this model needs "
                             f"[r, {in_size}] and [{outs[part]}, r]")
        if r > max_rank:
            raise ValueError(f"LoRA adapter {name!r}: rank {r} is above --max-lora-rank "
                             f"{max_rank}")
        scale = alpha / (math.sqrt(r) if config.get("use_rslora") else r)
        adapter.rank = max(adapter.rank, r)
        adapter.weights[layer, proj, part] = (a.to(dtype).contiguous(),
                                              (b.double() * scale).to(dtype).contiguous())
    if not adapter.weights:
        raise ValueError(f"LoRA adapter {name!r}: no LoRA weights in its weights file")
    digest = hashlib.sha256()
    for where, (a, b) in sorted(adapter.weights.items()):
        digest.update(repr(where).encode())
        for t in (a, b):
            digest.update(t.float().numpy().tobytes())
    adapter.fingerprint, adapter.key = digest.hexdigest(), name
    return adapter


def _file(path: str, file: str, root: str | None, said: str = "") -> str:
    """A file of the adapter directory, resolved and held beneath `root` when one is given
    (a link in the directory must not lead out); Unreadable where it is not a file."""
    if not os.path.isdir(path):
        raise Unreadable(f"{path!r} is not a directory")
    where = os.path.join(path, file)
    if root is not None:
        where = beneath(root, where)
    if not os.path.isfile(where):
        raise Unreadable(f"{path!r} has no {said or file}")
    return where


def _read_config(name: str, path: str, root: str | None) -> dict:
    file = _file(path, "adapter_config.json", root)
    try:
        with open(file, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise Unreadable(f"{file!r} does not open ({e.strerror})") from None
    try:
        config = json.loads(text)
    except ValueError as e:
        raise ValueError(f"LoRA adapter {name!r}: adapter_config.json does not read ({e})") \
            from None
    if not isinstance(config, dict):
        raise ValueError(f"LoRA adapter {name!r}: adapter_config.json is not an object")
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {name!r}: peft_type {shown(config['peft_type'])} is "
                         "not LORA")
    if not isinstance(config.get("r"), int) or config["r"] < 1:
        raise ValueError(f"LoRA adapter {name!r}: adapter_config.json needs r >= 1")
    return config


def _read_weights(name: str, path: str, root: str | None) -> dict[str, torch.Tensor]:
    st = "adapter_model.safetensors"
    if not os.path.lexists(os.path.join(path, st)) \
            and os.path.lexists(os.path.join(path, "adapter_model.bin")):
        st = "adapter_model.bin"
    file = _file(path, st, root, "adapter_model.safetensors (or .bin)")
    try:  # (a hub cache's files are links to blobs: the link's name says the format)
        if st.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(file)
        return torch.load(file, map_location="cpu", weights_only=True)
    except OSError as e:
        raise Unreadable(f"{file!r} does not open ({e.strerror})") from None
    except Exception as e:  # a truncated or foreign file: say so, never crash the worker
        raise ValueError(f"LoRA adapter {name!r}: its weights do not read "
                         f"({type(e).__name__}: {shown(str(e))})") from None


def _pairs(name: str, tensors: dict[str, torch.Tensor], c: ModelConfig) -> dict:
    """(layer, HF module) -> {"A": tensor, "B": tensor}; ValueError on a weight that is
    not a LoRA A or B of a module this model has."""
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise ValueError(f"LoRA adapter {name!r}: weight {key} is not a LoRA A or B of "
                             f"a layer's projection (only {sorted(TARGETS)} are served)")
        layer, module, which = int(m.group(1)), m.group(2), m.group(3)
        if module not in TARGETS or layer >= c.num_layers:
            raise ValueError(f"LoRA adapter {name!r}: weight {key} targets a module "
                             f"{c.architecture} does not have")
        if not t.is_floating_point():
            raise ValueError(f"LoRA adapter {name!r}: weight {key} is not floating point")
        pairs.setdefault((layer, module), {})[which] = t
    return pairs

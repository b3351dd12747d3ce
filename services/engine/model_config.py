"""The shape of a decoder-only model, read from an HF config or from GGUF metadata.

One dataclass covers every family Baton serves: the families differ only in switches
(biases, q/k norm, Gemma's sandwich norms and soft-capping, sliding windows, RoPE
variants), which the shared layers in `models/layers.py` read. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# HF architecture name -> Baton family (the module in services/engine/models/).
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
}
# RoPE variants Baton computes (models/layers.py: rope_inv_freq).
ROPE_TYPES = ("default", "linear", "llama3")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings")


def unsupported_architecture(arch: object) -> ValueError:
    return ValueError(f"unsupported architecture {arch!r}; Baton serves "
                      f"{', '.join(sorted(ARCHITECTURES))}")


@dataclass(frozen=True)
class Rope:
    """One RoPE table: base theta, and a scaling (`kind` in ROPE_TYPES) with its numbers
    (`factor`, and llama3's band limits) as sorted (name, value) pairs."""

    theta: float = 10000.0
    kind: str = "default"
    params: tuple[tuple[str, float], ...] = ()

    @staticmethod
    def from_hf(p: dict[str, Any], fallback_theta: float = 10000.0) -> Rope:
        kind = p.get("rope_type", p.get("type")) or "default"
        if kind not in ROPE_TYPES:
            raise ValueError(f"unsupported rope type {kind!r}; Baton computes "
                             f"{', '.join(ROPE_TYPES)}")
        keys = {"linear": ("factor",), "llama3": _LLAMA3_KEYS}.get(kind, ())
        theta = float(p.get("rope_theta", fallback_theta))
        return Rope(theta, kind, tuple(sorted((k, float(p[k])) for k in keys)))


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    rope: Rope = Rope()
    family: str = "llama"
    qkv_bias: bool = False  # Qwen2; Llama/Gemma with attention_bias
    o_bias: bool = False  # attention_bias (Llama, Mistral, Qwen3, Gemma)
    mlp_bias: bool = False  # Llama's mlp_bias
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)
    # Gemma: norms scale by (1 + w), embeddings by sqrt(hidden), a norm after attention
    # and after the MLP too (sandwich), GELU (tanh) in the MLP.
    norm_offset: float = 0.0
    embed_scale: bool = False
    sandwich_norms: bool = False
    hidden_act: str = "silu"  # or "gelu_tanh"
    query_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float | None = None  # scores -> c * tanh(scores / c) (Gemma 2)
    final_softcap: float | None = None  # the same on the logits
    # Per layer: the sliding window (HF `sliding_window`: a token sees the last W
    # positions, itself included), None for full attention.
    windows: tuple[int | None, ...] = ()
    sliding_rope: Rope | None = None  # Gemma 3: the sliding layers' own RoPE
    sliding_layers: tuple[int, ...] = ()  # the layers of type "sliding_attention"
    dtype: str | None = None  # the checkpoint's (config.json `dtype`); None for GGUF

    @property
    def scale(self) -> float:
        return self.query_scale if self.query_scale is not None else self.head_dim**-0.5

    def window(self, layer: int) -> int | None:
        return self.windows[layer] if self.windows else None

    @staticmethod
    def from_hf(cfg: Any) -> ModelConfig:
        """From a transformers `PretrainedConfig` (v4 `rope_scaling` or v5
        `rope_parameters`). ValueError, naming it, for an architecture Baton lacks."""
        arch = (getattr(cfg, "architectures", None) or [None])[0]
        arch = arch or {f: a for a, f in ARCHITECTURES.items()}.get(
            cfg.model_type.removesuffix("_text"), cfg.model_type)
        family = ARCHITECTURES.get(arch) if isinstance(arch, str) else None
        if family is None:
            raise unsupported_architecture(arch)
        assert isinstance(arch, str)  # ARCHITECTURES has it
        get = lambda name, default=None: getattr(cfg, name, default)  # noqa: E731
        layers = cfg.num_hidden_layers
        rope, sliding_rope = _ropes(cfg)
        kinds = _layer_types(cfg, family)
        windows: tuple[int | None, ...] = ()
        if kinds and get("sliding_window"):
            windows = tuple(cfg.sliding_window if k == "sliding_attention" else None
                            for k in kinds)
        elif family == "mistral" and get("sliding_window"):
            windows = (cfg.sliding_window,) * layers
        eos = cfg.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None
                                                                     else ())
        gemma = family in ("gemma2", "gemma3")
        bias = bool(get("attention_bias", False))
        scalar = get("query_pre_attn_scalar") if gemma else None
        return ModelConfig(
            architecture=arch,
            family=family,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=layers,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=get("num_key_value_heads") or cfg.num_attention_heads,
            head_dim=get("head_dim") or cfg.hidden_size // cfg.num_attention_heads,
            rms_norm_eps=cfg.rms_norm_eps,
            max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
            rope=rope,
            sliding_rope=sliding_rope,
            qkv_bias=bias or family == "qwen2",
            o_bias=bias,
            mlp_bias=bool(get("mlp_bias", False)),
            qk_norm=family in ("qwen3", "gemma3"),
            norm_offset=1.0 if gemma else 0.0,
            embed_scale=gemma,
            sandwich_norms=gemma,
            hidden_act=_activation(get("hidden_activation") or get("hidden_act", "silu")),
            query_scale=float(scalar) ** -0.5 if scalar else None,
            attn_softcap=get("attn_logit_softcapping") if gemma else None,
            final_softcap=get("final_logit_softcapping") if gemma else None,
            windows=windows if any(w is not None for w in windows) else (),
            sliding_layers=tuple(i for i, k in enumerate(kinds or ())
                                 if k == "sliding_attention"),
            # v5 says `dtype`; v4 `torch_dtype` (read from __dict__: v5 warns on the name).
            dtype=_dtype_name(get("dtype") or vars(cfg).get("torch_dtype")),
        )

    @staticmethod
    def from_gguf(meta: dict[str, Any], has_output_weight: bool) -> ModelConfig:
        """From GGUF key/values (`<arch>.*` and `tokenizer.ggml.*`), for the families whose
        llama.cpp layout Baton reads: llama (Llama, Mistral, SmolLM2), qwen2, qwen3, gemma2,
        gemma3 (text)."""
        arch = meta["general.architecture"]
        if arch not in GGUF_ARCHITECTURES:
            raise ValueError(f"unsupported GGUF architecture {arch!r}; Baton reads GGUF "
                             f"{', '.join(GGUF_ARCHITECTURES)} (other families: use the "
                             "HF directory)")

        def get(key: str, default: Any = None) -> Any:
            return meta.get(f"{arch}.{key}", default)

        hidden, heads = get("embedding_length"), get("attention.head_count")
        rope = Rope(float(get("rope.freq_base", 10000.0)))
        kind = get("rope.scaling.type")
        if kind == "linear":
            rope = Rope(rope.theta, "linear", (("factor", float(get("rope.scaling.factor"))),))
        elif kind not in (None, "none"):
            raise ValueError(f"unsupported GGUF rope scaling {kind!r}")
        window = get("attention.sliding_window")
        layers = get("block_count")
        head_dim = (get("attention.key_length") or get("rope.dimension_count")
                    or hidden // heads)
        extra: dict[str, Any] = {"windows": (window,) * layers if window else ()}
        if arch.startswith("gemma"):
            extra = _gguf_gemma(arch, get, layers, hidden // heads, head_dim, window)
        return ModelConfig(
            architecture=GGUF_ARCHITECTURES[arch],
            family=ARCHITECTURES[GGUF_ARCHITECTURES[arch]],
            vocab_size=get("vocab_size") or len(meta["tokenizer.ggml.tokens"]),
            hidden_size=hidden,
            intermediate_size=get("feed_forward_length"),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=get("attention.head_count_kv", heads),
            head_dim=head_dim,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
            max_position_embeddings=get("context_length"),
            tie_word_embeddings=not has_output_weight,
            # Chat GGUFs name the end of a turn apart (Gemma's <end_of_turn>).
            eos_token_ids=tuple(dict.fromkeys(
                meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
                if meta.get(k) is not None)),
            rope=rope,
            qkv_bias=arch == "qwen2",
            qk_norm=arch in ("qwen3", "gemma3"),
            **extra,
        )


GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                      "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
                      "gemma3": "Gemma3ForCausalLM"}


def _gguf_gemma(arch: str, get, layers: int, hidden_per_head: int, head_dim: int,
                window: int | None) -> dict[str, Any]:
    """What a Gemma GGUF leaves implicit, as llama.cpp (and transformers' GGUF reader)
    assume it: Gemma 2 windows every other layer from the first, Gemma 3 all but every
    sixth, whose local RoPE base is 10000; queries scale by head_dim ** -0.5, except in
    the 27B models (46 / 62 layers), by (hidden / heads) ** -0.5."""
    if arch == "gemma2":
        sliding = [i % 2 == 0 for i in range(layers)]
        caps = {"attn_softcap": float(get("attn_logit_softcapping", 50.0)),
                "final_softcap": float(get("final_logit_softcapping", 30.0))}
        local = None
    else:
        sliding = [(i + 1) % 6 != 0 for i in range(layers)]
        caps = {}
        local = Rope(10000.0)
    big = layers == (46 if arch == "gemma2" else 62)
    return dict(norm_offset=1.0, embed_scale=True, sandwich_norms=True,
                hidden_act="gelu_tanh", sliding_rope=local,
                query_scale=float(hidden_per_head if big else head_dim) ** -0.5,
                windows=tuple(window if s else None for s in sliding) if window else (),
                sliding_layers=tuple(i for i, s in enumerate(sliding) if s), **caps)


def _ropes(cfg: Any) -> tuple[Rope, Rope | None]:
    """(the RoPE of full-attention layers, that of sliding layers if they differ).

    transformers v5 writes `rope_parameters`, per layer type for Gemma 3; v4 wrote
    `rope_theta` with `rope_scaling`, and Gemma 3's `rope_local_base_freq`."""
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    theta = float(getattr(cfg, "rope_theta", None) or 10000.0)
    if "full_attention" in params:
        full = Rope.from_hf(params["full_attention"], theta)
        local = params.get("sliding_attention")
        return full, Rope.from_hf(local, theta) if local else None
    full = Rope.from_hf(params, theta)
    local_theta = getattr(cfg, "rope_local_base_freq", None)
    return full, Rope(float(local_theta)) if local_theta else None


def _layer_types(cfg: Any, family: str) -> list[str] | None:
    """Each layer's attention type. transformers >= 4.53 writes `layer_types`; before it,
    Gemma 2 alternated from a sliding first layer, and Gemma 3 made every
    `sliding_window_pattern`-th layer global."""
    kinds = getattr(cfg, "layer_types", None)
    if kinds or family not in ("gemma2", "gemma3"):
        return kinds
    n = cfg.num_hidden_layers
    if family == "gemma2":
        return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    every = getattr(cfg, "sliding_window_pattern", None) or 6
    return ["full_attention" if (i + 1) % every == 0 else "sliding_attention"
            for i in range(n)]


def _dtype_name(dtype: Any) -> str | None:
    """'bfloat16' from torch.bfloat16 or from the string."""
    return str(dtype).removeprefix("torch.") if dtype is not None else None


def _activation(name: object) -> str:
    if name == "silu":
        return "silu"
    if name in ("gelu_pytorch_tanh", "gelu_tanh"):
        return "gelu_tanh"
    raise ValueError(f"unsupported MLP activation {name!r}")

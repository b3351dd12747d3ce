"""The shape of a Llama-family model, read from an HF config or from GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    # llama3 scaling: {"factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"}; None for plain RoPE.
    rope_llama3: tuple[tuple[str, float], ...] | None = None
    attention_bias: bool = False

    @staticmethod
    def from_hf(cfg: Any) -> ModelConfig:
        """From a transformers `PretrainedConfig` (v4 `rope_scaling` or v5 `rope_parameters`)."""
        arch = (getattr(cfg, "architectures", None) or [cfg.model_type])[0]
        rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
        theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        llama3 = None
        if rope_type == "llama3":
            keys = ("factor", "low_freq_factor", "high_freq_factor",
                    "original_max_position_embeddings")
            llama3 = tuple((k, float(rope[k])) for k in keys)
        elif rope_type not in ("default", None):
            raise ValueError(f"unsupported rope type {rope_type!r}")
        eos = cfg.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None
                                                                     else ())
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return ModelConfig(
            architecture=arch,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=float(theta),
            max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
            rope_llama3=llama3,
            attention_bias=bool(getattr(cfg, "attention_bias", False)),
        )

    @staticmethod
    def from_gguf(meta: dict[str, Any], has_output_weight: bool) -> ModelConfig:
        """From GGUF key/values (`llama.*` and `tokenizer.ggml.*`)."""
        arch = meta["general.architecture"]
        if arch != "llama":
            raise ValueError(f"unsupported GGUF architecture {arch!r}")

        def get(key: str, default: Any = None) -> Any:
            return meta.get(f"{arch}.{key}", default)

        hidden, heads = get("embedding_length"), get("attention.head_count")
        llama3 = None
        if get("rope.scaling.type") == "llama3":  # rarely written; kept for completeness
            llama3 = (("factor", float(get("rope.scaling.factor"))),
                      ("low_freq_factor", 1.0), ("high_freq_factor", 4.0),
                      ("original_max_position_embeddings",
                       float(get("rope.scaling.original_context_length"))))
        return ModelConfig(
            architecture="LlamaForCausalLM",
            vocab_size=get("vocab_size") or len(meta["tokenizer.ggml.tokens"]),
            hidden_size=hidden,
            intermediate_size=get("feed_forward_length"),
            num_layers=get("block_count"),
            num_heads=heads,
            num_kv_heads=get("attention.head_count_kv", heads),
            head_dim=get("rope.dimension_count", hidden // heads),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            max_position_embeddings=get("context_length"),
            tie_word_embeddings=not has_output_weight,
            eos_token_ids=(meta["tokenizer.ggml.eos_token_id"],),
            rope_llama3=llama3,
        )

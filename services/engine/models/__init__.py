"""Model implementations written for the flat paged batch, one module per family; the
pieces they share are in layers.py. Which HF architecture maps to which family is
services/engine/model_config.py's ARCHITECTURES (torch-free, so start-up refuses an
unknown one before loading anything)."""

from __future__ import annotations

from ..model_config import ARCHITECTURES, unsupported_architecture
from .gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from .llama import LlamaForCausalLM
from .mistral import MistralForCausalLM
from .qwen import Qwen2ForCausalLM, Qwen3ForCausalLM

MODELS = {cls.__name__: cls for cls in (LlamaForCausalLM, MistralForCausalLM,
                                        Qwen2ForCausalLM, Qwen3ForCausalLM,
                                        Gemma2ForCausalLM, Gemma3ForCausalLM)}
assert set(MODELS) == set(ARCHITECTURES)


def model_class(architecture: str):
    cls = MODELS.get(architecture)
    if cls is None:
        raise unsupported_architecture(architecture)
    return cls

"""The engine: block pool, KV-cache manager, scheduler, model runner, sampler, detokenizer.

`from baton.services.engine import LLM, SamplingParams` is the offline API. The names load on
first use, so that `baton.services.engine.config` (torch-free) imports without the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what __getattr__ below loads, as checkers and editors see it
    from ..common.sampling_params import SamplingParams
    from .config import EngineConfig
    from .engine import LLMEngine
    from .llm import LLM
    from .outputs import RequestOutput

__all__ = ["LLM", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams"]


def __getattr__(name: str):
    if name == "LLM":
        from .llm import LLM

        return LLM
    if name == "LLMEngine":
        from .engine import LLMEngine

        return LLMEngine
    if name == "EngineConfig":
        from .config import EngineConfig

        return EngineConfig
    if name == "RequestOutput":
        from .outputs import RequestOutput

        return RequestOutput
    if name == "SamplingParams":
        from ..common.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'baton.services.engine' has no attribute {name!r}")

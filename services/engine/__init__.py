"""The engine: block pool, KV-cache manager, scheduler, model runner, sampler, detokenizer.

`from baton.services.engine import LLM, SamplingParams` is the offline API. The names load on
first use, so that `baton.services.engine.config` (torch-free) imports without the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what __getattr__ below loads, as checkers and editors see it
    from baton.services.common.sampling_params import SamplingParams
    from baton.services.engine.config import EngineConfig
    from baton.services.engine.engine import LLMEngine
    from baton.services.engine.llm import LLM
    from baton.services.engine.outputs import RequestOutput

__all__ = ["LLM", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams"]


def __getattr__(name: str):
    if name == "LLM":
        from baton.services.engine.llm import LLM

        return LLM
    if name == "LLMEngine":
        from baton.services.engine.engine import LLMEngine

        return LLMEngine
    if name == "EngineConfig":
        from baton.services.engine.config import EngineConfig

        return EngineConfig
    if name == "RequestOutput":
        from baton.services.engine.outputs import RequestOutput

        return RequestOutput
    if name == "SamplingParams":
        from baton.services.common.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'baton.services.engine' has no attribute {name!r}")

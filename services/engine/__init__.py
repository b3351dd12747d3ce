"""The engine: block pool, KV-cache manager, scheduler, model runner, sampler, detokenizer."""

from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.llm import LLM
from services.engine.outputs import RequestOutput
from services.engine.sampling_params import SamplingParams

__all__ = ["LLM", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams"]

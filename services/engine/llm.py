"""The offline API, vLLM-like: `LLM(...).generate(prompts, sampling_params)`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from ..common.sampling_params import SamplingParams
from ..lora.adapter import LoRARequest
from .config import EngineConfig
from .engine import LLMEngine, ReceiverFactory
from .outputs import RequestOutput


class LLM:
    def __init__(self, model: str | None = None, kv_receiver: ReceiverFactory | None = None,
                 **kwargs):
        """kwargs are EngineConfig fields: dtype, block_size, max_num_seqs,
        max_num_batched_tokens, kv_cache_gib, max_model_len, enforce_eager, ...
        `kv_receiver` builds a KV receiver over the engine's caches (decode role)."""
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs), kv_receiver=kv_receiver)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: str | list[int] | Sequence[str] | Sequence[list[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 cache_salt: str | Sequence[str | None] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the prompts' order.

        Every prompt is validated before any is queued, so bad input queues nothing.
        `lora_request`: the LoRA adapter of every prompt, or one per prompt (vLLM's).
        """
        batch: list[str | list[int]]
        if isinstance(prompts, str):
            batch = [prompts]
        elif prompts and isinstance(prompts[0], int):  # one prompt of token ids
            batch = [list(cast(list[int], prompts))]
        else:
            batch = list(cast(Sequence[str | list[int]], prompts))
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.get_default_sampling_params()] * len(batch)
        else:
            params = list(sampling_params)
            if len(params) != len(batch):
                raise ValueError(f"got {len(params)} sampling params for {len(batch)} prompts")
        salts = _per_prompt(cache_salt, str, len(batch), "cache salts")
        loras = _per_prompt(lora_request, LoRARequest, len(batch), "LoRA requests")
        # Constraints compile here, before anything is queued (never inside step()).
        constraints = [getattr(p, "structured", None) for p in params]
        grammars = [c if c is None else self.engine.grammars.compile(c) for c in constraints]
        ids = []
        try:
            for prompt, p, salt, g, lora in zip(batch, params, salts, grammars, loras,
                                                strict=True):
                ids.append(self.engine.add_request(prompt, p, cache_salt=salt, grammar=g,
                                                   lora=lora))
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        final: dict[str, RequestOutput] = {}
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        final[out.request_id] = out
        finally:  # an error or Ctrl-C mid-run must not leave requests holding blocks
            for rid in ids:
                if rid not in final:
                    self.engine.abort_request(rid)
        return [final[i] for i in ids]

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams' defaults, overridden by the model's generation_config.json
        (see services/common/generation_config.py)."""
        return SamplingParams(**self.engine.sampling_defaults)

    def reset_prefix_cache(self) -> int:
        return self.engine.reset_prefix_cache()

    def chat(self, messages: list[dict[str, str]],
             sampling_params: SamplingParams | None = None) -> RequestOutput:
        return self.generate([self.engine.apply_chat_template(messages)], sampling_params)[0]


def _per_prompt(value, kind: type, n: int, what: str) -> list:
    """One value for every prompt, or a sequence with one per prompt."""
    if value is None or isinstance(value, kind):
        return [value] * n
    values = list(value)
    if len(values) != n:
        raise ValueError(f"got {len(values)} {what} for {n} prompts")
    return values

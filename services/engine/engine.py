"""The step-level engine the services drive: add_request, step, abort_request."""

from __future__ import annotations

import itertools
import logging
import time

from services.engine.block_pool import BlockPool
from services.engine.config import EngineConfig
from services.engine.detokenizer import IncrementalDetokenizer
from services.engine.kv_cache_manager import KVCacheManager
from services.engine.loader import load_checkpoint, resolve_model_path
from services.engine.model_runner import ModelRunner
from services.engine.outputs import RequestOutput
from services.engine.request import Request, RequestStatus
from services.engine.sampling_params import SamplingParams
from services.engine.scheduler import Scheduler
from services.engine.tokenizer import load_tokenizer

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        t0 = time.monotonic()
        path = resolve_model_path(config.model)
        self.tokenizer = load_tokenizer(path)
        model_config, weights = load_checkpoint(path)
        self.model_config = model_config
        limit = model_config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's "
                             f"max_position_embeddings {limit}")
        max_len = config.max_model_len or limit
        self.runner = ModelRunner(config, model_config, weights, max_len)
        num_blocks = self.runner.profile_num_blocks()
        # One request must always fit alone, or it could never finish.
        capacity = (num_blocks - 1) * config.block_size
        if capacity < 2:
            raise ValueError(f"the KV budget holds only {num_blocks} blocks; raise kv_cache_gib "
                             "or gpu_memory_utilization")
        if config.max_model_len is not None and config.max_model_len > capacity:
            raise ValueError(f"max_model_len {config.max_model_len} does not fit in the KV "
                             f"cache ({capacity} tokens); raise the KV budget")
        self.max_model_len = min(max_len, capacity)
        self.runner.allocate_kv_cache(num_blocks)
        self.pool = BlockPool(num_blocks)
        self.kv = KVCacheManager(self.pool, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len, config.scheduling_policy)
        self.runner.maybe_capture_graphs(config.max_num_seqs, self.max_model_len)
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._ids = itertools.count()
        log.info("engine ready in %.1fs: %s, %s, max_model_len %d", time.monotonic() - t0,
                 model_config.architecture, config.dtype, self.max_model_len)

    # ---- requests -------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0,
                    cache_salt: str | None = None) -> str:
        """Validate and queue a request; raise ValueError (nothing queued) on bad input."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params)}")
        token_ids = self._tokenize(prompt)
        if not token_ids:
            raise ValueError("prompt is empty")
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens, more than max_model_len "
                             f"{self.max_model_len}")
        vocab = self.model_config.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {cache_salt!r}")
        req = Request(request_id, token_ids, params, self.model_config.eos_token_ids, priority,
                      cache_salt=cache_salt)
        self.scheduler.add_request(req)  # raises on a duplicate id, before anything else
        self._detok[request_id] = IncrementalDetokenizer(
            self.tokenizer, token_ids, stop=params.stop,
            skip_special_tokens=params.skip_special_tokens,
            include_stop_str_in_output=params.include_stop_str_in_output)
        return request_id

    def _tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True) if prompt else []
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt)}")

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        """Chat messages through the model's chat template, ending with the assistant turn."""
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=True)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self.scheduler.abort(request_id)
        if req is None:
            return None
        detok = self._detok.pop(request_id)
        return self._output(req, [], detok.flush(), detok)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- prefix cache ---------------------------------------------------------------

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix; returns how many cached blocks were dropped."""
        return self.pool.reset_prefix_cache()

    def prefix_cache_stats(self) -> dict[str, float]:
        """Token hits and queries since start, the hit rate, and evicted cached blocks."""
        q, h = self.kv.num_queries, self.kv.num_hits
        return {"queries": q, "hits": h, "hit_rate": h / q if q else 0.0,
                "evictions": self.pool.num_evictions}

    # ---- the step -------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample, and report every request that advanced."""
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return []
        sampled = self.runner.execute(sched, self.kv)
        advanced = self.scheduler.update(sched, {k: v.token_id for k, v in sampled.items()})
        outputs = []
        for req in advanced:
            s = sampled[req.request_id]
            if req.params.logprobs is not None:
                req.logprobs.append(s.logprobs or {})
            detok = self._detok[req.request_id]
            delta = detok.update([s.token_id])
            if detok.stop_matched is not None:
                if not req.status.finished:
                    self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
                else:  # a length limit on the same token: the stop string wins (as vLLM)
                    req.status = RequestStatus.FINISHED_STOPPED
            elif req.status.finished:
                delta += detok.flush()
            outputs.append(self._output(req, [s.token_id], delta, detok))
            if req.status.finished:
                del self._detok[req.request_id]
        return outputs

    def _output(self, req: Request, new_ids: list[int], delta: str,
                detok: IncrementalDetokenizer) -> RequestOutput:
        finished = req.status.finished
        stop_reason = None
        if req.status == RequestStatus.FINISHED_STOPPED:
            last = req.token_ids[-1]
            stop_reason = detok.stop_matched or (last if last in req.stop_ids else None)
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            token_ids=req.output_token_ids,
            text=detok.text,
            new_token_ids=new_ids,
            new_text=delta,
            finish_reason=req.status.value if finished else None,
            stop_reason=stop_reason,
            logprobs=list(req.logprobs) if req.params.logprobs is not None else None,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            num_preemptions=req.num_preemptions,
        )

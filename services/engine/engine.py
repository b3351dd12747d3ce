"""The step-level engine the services drive: add_request, step, abort_request."""

from __future__ import annotations

import itertools
import logging
import time

import torch

from services.engine.block_pool import BlockPool
from services.engine.config import EngineConfig
from services.engine.detokenizer import IncrementalDetokenizer
from services.engine.kv_cache_manager import KVCacheManager
from services.engine.kv_layout import TransferState
from services.engine.loader import load_checkpoint, resolve_model_path
from services.engine.model_runner import ModelRunner
from services.engine.outputs import RequestOutput
from services.engine.request import RemoteKV, Request, RequestStatus
from services.engine.sampling_params import SamplingParams
from services.engine.scheduler import Scheduler
from services.engine.tokenizer import load_tokenizer

log = logging.getLogger(__name__)

LOAD_WAIT_S = 0.005  # how long a step may wait for the remote KV loads it just started


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        t0 = time.monotonic()
        path = resolve_model_path(config.model)
        self.model_name = path.name  # the file or directory name: the same on every host
        self.tokenizer = load_tokenizer(path)
        model_config, weights = load_checkpoint(path, config.load_format, config.seed)
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
        self.scheduler.lease_timeout_s = config.kv_lease_timeout_s
        self.scheduler.load_failure_policy = config.kv_load_failure_policy
        # Decode role: pulls remote KV (a kv_transfer receiver), set by the worker.
        self.kv_receiver = None
        self.runner.maybe_capture_graphs(config.max_num_seqs, self.max_model_len)
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._ids = itertools.count()
        log.info("engine ready in %.1fs: %s, %s, max_model_len %d", time.monotonic() - t0,
                 model_config.architecture, config.dtype, self.max_model_len)

    # ---- requests -------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0,
                    cache_salt: str | None = None, kv_hold: bool = False) -> str:
        """Validate and queue a request; raise ValueError (nothing queued) on bad input.

        `kv_hold` (prefill role): the request ends after its first token unless that token
        finishes it, and its blocks stay held (`kv_block_ids` in that output) until
        release_lease() or the lease timeout.
        """
        req = self._make_request(prompt, params, request_id, priority, cache_salt)
        req.kv_hold = kv_hold
        self._queue(req)
        return req.request_id

    def add_remote_request(self, prompt_token_ids: list[int], first_token: int,
                           remote: RemoteKV, params: SamplingParams | None = None,
                           request_id: str | None = None, priority: int = 0,
                           cache_salt: str | None = None) -> str:
        """Decode role: continue a request whose prompt KV sits on another engine and whose
        first token was sampled there. Only blocks missing from our prefix cache are pulled
        (through `kv_receiver`); the request then decodes in the running batch."""
        if self.kv_receiver is None:
            raise ValueError("this engine has no KV receiver: it cannot take remote KV")
        n = len(prompt_token_ids)
        if remote.num_tokens != n:
            raise ValueError(f"remote KV holds {remote.num_tokens} tokens, the prompt has {n}")
        need = -(-n // self.config.block_size)
        if len(remote.block_ids) != need:
            raise ValueError(f"remote KV has {len(remote.block_ids)} blocks, {n} tokens need "
                             f"{need}")
        return self.resume_request(prompt_token_ids, [first_token], params, request_id,
                                   priority, cache_salt, remote)

    def resume_request(self, prompt_token_ids: list[int], output_token_ids: list[int],
                       params: SamplingParams | None = None, request_id: str | None = None,
                       priority: int = 0, cache_salt: str | None = None,
                       remote: RemoteKV | None = None) -> str:
        """Continue a request whose first outputs were sampled elsewhere (a prefill engine,
        or a decode engine that died): without `remote`, its KV is computed here. The
        outputs count toward max_tokens, and the detokenizer and a seeded generator are
        brought to the state they would have had, so the stream goes on seamlessly."""
        req = self._make_request(list(prompt_token_ids), params, request_id, priority,
                                 cache_salt)
        params = req.params
        outs = list(output_token_ids)
        vocab = self.model_config.vocab_size
        bad = next((t for t in outs if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"output token id {bad} is outside the vocabulary [0, {vocab})")
        if (len(outs) >= params.max_tokens
                or req.num_prompt_tokens + len(outs) >= self.max_model_len):
            raise ValueError("nothing left to decode: max_tokens or max_model_len is reached")
        req.token_ids.extend(outs)
        req.remote = remote
        self._queue(req)
        if req.generator is not None and not params.greedy:
            # The other engine drew once from this seed per token it sampled; draw the same
            # noise here. (sampler.py: one Exponential(1) vector of vocab size per token.)
            for _ in outs:
                torch.empty(vocab).exponential_(generator=req.generator)
        # Those tokens' text was already streamed; replaying them puts this detokenizer in
        # the same state (held-back bytes and stop-string tail).
        self._detok[req.request_id].update(outs)
        return req.request_id

    def _make_request(self, prompt, params, request_id, priority, cache_salt) -> Request:
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
        return Request(request_id, token_ids, params, self.model_config.eos_token_ids,
                       priority, cache_salt=cache_salt)

    def _queue(self, req: Request) -> None:
        self.scheduler.add_request(req)  # raises on a duplicate id, before anything else
        params = req.params
        self._detok[req.request_id] = IncrementalDetokenizer(
            self.tokenizer, req.prompt_token_ids, stop=params.stop,
            skip_special_tokens=params.skip_special_tokens,
            include_stop_str_in_output=params.include_stop_str_in_output)

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
        """End a request wherever it is; for a prefilled one, release its held blocks."""
        self.scheduler.release_lease(request_id)
        req = self.scheduler.abort(request_id)
        if req is None:
            return None
        detok = self._detok.pop(request_id)
        return self._output(req, [], detok.flush(), detok)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def release_lease(self, request_id: str) -> bool:
        """Prefill role: free the blocks held for a handed-off request."""
        return self.scheduler.release_lease(request_id)

    def stats(self) -> dict[str, int | float]:
        """Load and memory figures for routing and for tests of the pool invariant."""
        s = self.scheduler
        return {"num_waiting": len(s.waiting), "num_running": len(s.running),
                "num_loading": len(s.loading), "num_leases": len(s.leases),
                "num_blocks": self.pool.num_blocks - 1, "num_free_blocks":
                self.pool.num_free_blocks, "kv_usage": self.kv.usage,
                "num_blocks_pulled": s.num_blocks_pulled,
                "num_blocks_local": s.num_blocks_local, "num_preemptions": s.num_preemptions,
                "num_load_failures": s.num_load_failures,
                "num_leases_expired": s.num_leases_expired}

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
        """Schedule, run the model once, sample, and report every request that advanced
        (or failed). Also moves remote KV loads along and expires stale leases."""
        outputs = self._poll_loads()
        self.scheduler.expire_leases(time.monotonic())
        loads = self.scheduler.schedule_loads()
        if loads:
            self._start_loads(loads)
            outputs += self._wait_loads(LOAD_WAIT_S)
        sched = self.scheduler.schedule()
        self._start_loads(sched.loads)
        if not sched.scheduled:
            return outputs
        sampled = self.runner.execute(sched, self.kv)
        advanced = self.scheduler.update(sched, {k: v.token_id for k, v in sampled.items()})
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
                    if req.status == RequestStatus.PREFILLED:  # nothing left to hand off
                        self.scheduler.release_lease(req.request_id)
                    req.status = RequestStatus.FINISHED_STOPPED
            elif req.status.finished and req.status != RequestStatus.PREFILLED:
                delta += detok.flush()
            outputs.append(self._output(req, [s.token_id], delta, detok))
            if req.status.finished:
                del self._detok[req.request_id]
        return outputs

    def _start_loads(self, loads) -> None:
        for req, remote_ids, local_ids in loads:
            req.load_start = time.monotonic()
            if remote_ids:
                self.kv_receiver.start_load(req.request_id, req.remote.engine_id, remote_ids,
                                            local_ids)
            else:  # every remote block was in our own prefix cache
                self.scheduler.finish_load(req.request_id, None)

    def _wait_loads(self, budget_s: float) -> list[RequestOutput]:
        """Poll the loads just started for up to `budget_s`: a prompt's blocks are a few MB
        and usually land within a millisecond or two, and then the request decodes in this
        step instead of the next (a whole step later)."""
        deadline = time.monotonic() + budget_s
        outputs = self._poll_loads()
        while self.scheduler.loading and time.monotonic() < deadline:
            time.sleep(0.0002)
            outputs += self._poll_loads()
        return outputs

    def _poll_loads(self) -> list[RequestOutput]:
        """Finish every remote KV load the transport reports done; report failed ones."""
        outputs = []
        expired = set(self.scheduler.take_expired_loads())
        for rid in list(self.scheduler.loading):
            if rid in expired:
                state, error = TransferState.FAILED, "the prefill worker's lease expired"
            else:
                state, error = self.kv_receiver.poll(rid)
            if state not in (TransferState.SUCCESS, TransferState.FAILED):
                continue
            req = self.scheduler.finish_load(rid, None if state == TransferState.SUCCESS else
                                             error or "transfer failed")
            if req is not None and req.status.finished:
                detok = self._detok.pop(rid)
                outputs.append(self._output(req, [], "", detok))
        return outputs

    def _output(self, req: Request, new_ids: list[int], delta: str,
                detok: IncrementalDetokenizer) -> RequestOutput:
        finished = req.status.finished
        stop_reason = None
        if req.status == RequestStatus.FINISHED_STOPPED:
            last = req.token_ids[-1]
            stop_reason = detok.stop_matched or (last if last in req.stop_ids else None)
        prefilled = req.status == RequestStatus.PREFILLED
        t_sched, t_first = req.scheduled_time, req.first_token_time
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            token_ids=req.output_token_ids,
            text=detok.text,
            new_token_ids=new_ids,
            new_text=delta,
            finish_reason=req.status.value if finished and not prefilled else None,
            stop_reason=stop_reason,
            logprobs=list(req.logprobs) if req.params.logprobs is not None else None,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            num_preemptions=req.num_preemptions,
            error=req.error,
            kv_block_ids=self.kv.block_ids(req.request_id) if prefilled else None,
            queue_time=None if t_sched is None else t_sched - req.arrival_time,
            prefill_time=None if t_first is None or t_sched is None else t_first - t_sched,
            transfer_time=(None if req.load_end is None or req.load_start is None
                           else req.load_end - req.load_start),
        )

"""The step-level engine the services drive: add a request, step, abort.

    step():  schedule  ->  run the model once  ->  update (tokens, stops, outputs)

Workers see only this class's surface: requests in and out, `stats()`, the lease query
and release (prefill role), the KV caches and their layout (for the transfer connectors),
and `model_info`. The scheduler, pool and runner stay behind it. The decode role's KV
receiver is a collaborator given at construction (it needs the caches this constructor
allocates, so it comes as a factory).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable

from baton.kv_transfer.base import KVHandle, KVLayout, KVReceiver

from ..common.kv_events import KvEventLog
from ..common.limits import check_ceilings
from ..common.sampling_params import SamplingParams
from ..common.tokenizer import (
    apply_chat_template,
)
from ..lora.adapter import LoRARequest
from ..lora.registry import EngineLoras
from .block_pool import BlockPool
from .build import Built, load
from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer
from .engine_stats import engine_stats
from .grammar_compiler import GrammarCompiler
from .kv_cache_manager import KVCacheManager
from .kv_connector.context import ConnectorContext
from .kv_connector.registry import build as build_connectors
from .outputs import EngineStats, ModelInfo, RequestOutput
from .request import Request, RequestStatus
from .request_output import request_output
from .sampler import bad_words_ids
from .scheduler import Scheduler
from .spec_decode import NgramProposer
from .tp_ranks import Ranks

log = logging.getLogger(__name__)

# Builds the decode role's receiver over this engine's KV caches: (layout, rank caches).
ReceiverFactory = Callable[[KVLayout, list], KVReceiver]


class LLMEngine:
    def __init__(self, config: EngineConfig, kv_receiver: ReceiverFactory | None = None):
        t0 = time.monotonic()
        self.ranks = Ranks.start(config, self)  # tensor parallelism: this engine is rank 0
        try:  # whatever fails, the ranks and the connectors' threads stop
            self._build(load(config, self.ranks.group if self.ranks else None), kv_receiver)
        except BaseException:
            self.close()
            raise
        log.info("engine ready in %.1fs: %s, %s, max_model_len %d", time.monotonic() - t0,
                 self.model_config.architecture, self.config.dtype, self.max_model_len)

    def _build(self, built: Built, kv_receiver: ReceiverFactory | None) -> None:
        self.config = config = built.config
        self.model_name, self.tokenizer = built.model_name, built.tokenizer
        self.model_config = model_config = built.model_config
        self.sampling_defaults, self.runner = built.sampling_defaults, built.runner
        self.max_model_len, self.kv_layout = built.max_model_len, built.kv_layout
        num_blocks = built.num_blocks
        receiver = kv_receiver(self.kv_layout, self.rank_kv_caches) if kv_receiver else None
        # What the routers poll to learn which prefixes this engine holds (KV events).
        self.kv_events = KvEventLog()
        self.pool = BlockPool(num_blocks, self.kv_events)
        self.kv = KVCacheManager(self.pool, config.block_size, config.enable_prefix_caching)
        self.connectors = build_connectors(ConnectorContext(  # tiers read every rank's cache
            config, self.kv_layout, self.rank_kv_caches if config.kv_offload_enabled else [],
            receiver, self.kv_events, built.weights))
        self.kv.record_published = any(c.saves for c in self.connectors)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len, config.scheduling_policy,
                                   connectors=self.connectors,
                                   lease_timeout_s=config.kv_lease_timeout_s,
                                   load_failure_policy=config.kv_load_failure_policy,
                                   max_loras=config.max_loras if config.enable_lora else None)
        self.loras = EngineLoras(self.runner.lora, model_config, self._live_loras,
                                 config.lora_modules, config.lora_root)  # read now
        self.runner.maybe_capture_graphs(config.max_num_seqs, self.max_model_len)
        self.grammars = GrammarCompiler(
            self.tokenizer, model_config.vocab_size, tuple(model_config.eos_token_ids),
            timeout_s=config.grammar_compile_timeout_s,
            threads=config.grammar_compile_threads, max_pending=config.grammar_compile_queue)
        self.spec = (NgramProposer(config.speculative, self.max_model_len)
                     if config.speculative.method is not None else None)
        self.model_info = ModelInfo(
            model=self.model_name, architecture=model_config.architecture,
            family=model_config.family,
            served_model_name=config.served_model_name or self.model_name.removesuffix(".gguf"),
            max_model_len=self.max_model_len, vocab_size=model_config.vocab_size,
            eos_token_ids=tuple(model_config.eos_token_ids), block_size=config.block_size,
            dtype=config.dtype)
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._ids = itertools.count()

    def close(self) -> None:  # stops the connectors' threads and the tensor-parallel ranks
        for conn in getattr(self, "connectors", ()):
            conn.close()
        if self.ranks is not None:
            self.ranks.stop()

    @property
    def kv_caches(self) -> list:
        """One tensor per layer, `[K|V, kv_head, block, offset, head_dim]` (kv_transfer)."""
        return self.runner.kv_caches

    @property
    def rank_kv_caches(self) -> list[list]:
        """Every tensor-parallel rank's KV caches, rank-major (`[rank][layer]`), each rank
        holding its heads (kernels/kv_layout.rank_heads); [kv_caches] without TP."""
        return self.runner.rank_kv_caches

    # ---- requests -------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0,
                    cache_salt: str | None = None, kv_hold: bool = False,
                    grammar=None, lora: LoRARequest | None = None) -> str:
        """Validate and queue a request; raise ValueError (nothing queued) on bad input.
        `grammar`: its constraint compiled (`grammars.submit`); never compiled here.

        `lora`: the adapter it runs (None: the base model); NotFound if this engine
        neither holds it nor is given its path.

        `kv_hold` (prefill role): the request ends after its first token unless that token
        finishes it, and its blocks stay held under a lease (`kv_block_ids` and
        `kv_lease_id` in that output) until release_lease() or the lease timeout.
        """
        req = self._make_request(prompt, params, request_id, priority, cache_salt, grammar,
                                 lora)
        req.kv_hold = kv_hold
        self._queue(req)
        return req.request_id

    def add_remote_request(self, prompt_token_ids: list[int], first_token: int,
                           handle: KVHandle, params: SamplingParams | None = None,
                           request_id: str | None = None, priority: int = 0,
                           cache_salt: str | None = None, grammar=None,
                           lora: LoRARequest | None = None) -> str:
        """Decode role: continue a request whose prompt KV sits on another engine and whose
        first token was sampled there. Only blocks missing from our prefix cache are pulled;
        the request then decodes in the running batch."""
        handle.check(self.kv_layout, len(prompt_token_ids))
        return self.resume_request(prompt_token_ids, [first_token], params, request_id,
                                   priority, cache_salt, handle, grammar, lora)

    def resume_request(self, prompt_token_ids: list[int], output_token_ids: list[int],
                       params: SamplingParams | None = None, request_id: str | None = None,
                       priority: int = 0, cache_salt: str | None = None,
                       handle: KVHandle | None = None, grammar=None,
                       lora: LoRARequest | None = None) -> str:
        """Continue a request whose first outputs were sampled elsewhere (a prefill engine,
        or a decode engine that died): without a handle, its KV is computed here. The
        outputs count toward max_tokens, and the detokenizer and a seeded generator are
        brought to the state they would have had, so the stream goes on seamlessly."""
        req = self._make_request(list(prompt_token_ids), params, request_id, priority,
                                 cache_salt, grammar, lora)
        outs = list(output_token_ids)
        vocab = self.model_config.vocab_size
        bad = next((t for t in outs if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"output token id {bad} is outside the vocabulary [0, {vocab})")
        if (len(outs) >= req.params.max_tokens
                or req.num_prompt_tokens + len(outs) >= self.max_model_len):
            raise ValueError("nothing left to decode: max_tokens or max_model_len is reached")
        if req.grammar is not None:
            for i, t in enumerate(outs):
                if not req.grammar.accept(t):
                    raise ValueError(f"output token {t} (position {i}) does not fit the "
                                     "structured output constraint")
            if req.grammar.terminated:
                raise ValueError("nothing left to decode: the structured output constraint "
                                 "is complete")
        req.token_ids.extend(outs)
        req.remote = handle
        self._queue(req)
        if req.generator is not None and not req.params.greedy:
            self.runner.sampler.advance(req.generator, vocab, len(outs))
        # Those tokens' text was already streamed; replaying them puts this detokenizer in
        # the state the stream's had (held-back bytes and stop-string tail): its text is
        # not sent again.
        self._detok[req.request_id].update(outs)
        return req.request_id

    def _make_request(self, prompt, params, request_id, priority, cache_salt,
                      grammar, lora: LoRARequest | None = None) -> Request:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params)}")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
        check_ceilings("", {"request_id": request_id or "", "cache_salt": cache_salt or ""})
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
        if any(t >= vocab for t, _ in params.logit_bias):
            raise ValueError(f"logit_bias token ids must be in the vocabulary [0, {vocab})")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        req = Request(request_id, token_ids, params, self.model_config.eos_token_ids,
                      priority, cache_salt=cache_salt, lora_name=self.loras.resolve(lora))
        req.bad_words_ids = bad_words_ids(self.tokenizer, params.bad_words)
        if params.structured is not None:
            req.grammar = self.grammars.matcher(params.structured, grammar)
        return req

    def _queue(self, req: Request) -> None:
        self.scheduler.add_request(req)  # raises on a duplicate id, before anything else
        params = req.params
        self._detok[req.request_id] = IncrementalDetokenizer(
            self.tokenizer, req.prompt_token_ids, stop=params.stop,
            skip_special_tokens=params.skip_special_tokens,
            include_stop_str_in_output=params.include_stop_str_in_output,
            min_tokens=params.min_tokens)

    def _tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True) if prompt else []
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt)}")

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            template_kwargs: dict | None = None) -> list[int]:
        """Chat messages (and OpenAI function `tools`, more template variables) through
        the chat template, ending with the assistant turn (services/common/tokenizer.py)."""
        return apply_chat_template(self.tokenizer, messages, tools, template_kwargs,
                                   self.config.allow_special_tokens_in_content)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End a request wherever it is; for a prefilled one, release its held blocks."""
        req = self.scheduler.abort(request_id)
        self.loras.sweep()
        if req is None:
            return None
        return self._output(req, [], "")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def fail_all(self) -> None:
        """After a failed step: abort every request and lease, and drop the prefix cache
        (the step's blocks were published but maybe never written)."""
        for rid in list(self.scheduler.requests) + list(self.scheduler.leases):
            try:
                self.abort_request(rid)
            except Exception:  # noqa: BLE001 - end every other one whatever this one hit
                log.exception("abort of %s failed", rid)
        self.reset_prefix_cache()

    # ---- LoRA adapters (services/lora/registry.py) ------------------------------------

    def load_lora(self, name: str, path: str) -> None:
        """Read and check a PEFT directory now; ValueError says why it cannot serve."""
        self.loras.load(name, path)

    def unload_lora(self, name: str) -> bool:
        """New requests cannot name it; those running it finish. False if not loaded."""
        return self.loras.unload(name)

    def _live_loras(self) -> set[str | None]:
        s = self.scheduler
        return {r.lora_name for r in (*s.requests.values(), *s.loads.loading.values())}

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ---- leases (prefill role): each ends on the lease table's one path (leases.py) --

    def release_lease(self, request_id: str, lease_id: int | None = None) -> bool:
        """Free the blocks held for a handed-off request: True iff that lease (any lease
        of the request, when `lease_id` is None) was still held."""
        return self.scheduler.leases.release(request_id, lease_id)

    def revoke_lease(self, request_id: str, lease_id: int | None = None) -> bool:
        """release_lease for any thread (the only engine call that is): the lease ends
        now, its blocks are freed at the engine thread's next step (leases.py)."""
        return self.scheduler.leases.revoke(request_id, lease_id)

    def lease_blocks(self, request_id: str, lease_id: int) -> list[int] | None:
        """The blocks held under that exact lease, or None if it is not held (any thread)."""
        return self.scheduler.leases.blocks(request_id, lease_id)

    def expire_leases(self) -> list[str]:
        return self.scheduler.leases.expire(time.monotonic())

    def stats(self) -> EngineStats:
        return engine_stats(self)

    def connector_stats(self) -> dict[str, dict[str, int]]:
        """Each KV connector's counters, by its name (kv_connector/)."""
        return {c.name: c.stats() for c in self.connectors}

    # ---- prefix cache ---------------------------------------------------------------

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix; returns how many cached blocks were dropped."""
        return self.pool.reset_prefix_cache()

    def prefix_cache_stats(self) -> dict[str, float]:
        """Token hits and queries since start, the hit rate, and evicted cached blocks."""
        q, h = self.kv.num_queries, self.kv.num_hits
        return {"queries": q, "hits": h, "hit_rate": h / q if q else 0.0,
                "evictions": self.pool.num_evictions}

    # ---- scoring ----------------------------------------------------------------------

    def prompt_logprobs(self, prompt: str | list[int], chunk_tokens: int | None = None):
        """log p(token i | tokens before it) for every prompt token after the first, a
        [len - 1] fp32 tensor (perplexity: exp(-mean)). The prompt runs through the paged
        KV cache in chunks of `chunk_tokens` (default max_num_batched_tokens), in blocks
        taken from the pool and freed after; nothing is cached. Between steps only."""
        ids = self._tokenize(prompt)
        if not 2 <= len(ids) <= self.max_model_len:
            raise ValueError(f"scoring needs 2 to max_model_len {self.max_model_len} "
                             f"tokens, got {len(ids)}")
        if not all(0 <= t < self.model_config.vocab_size for t in ids):
            raise ValueError("a prompt token id is outside the vocabulary")
        chunk = chunk_tokens or self.config.max_num_batched_tokens
        if chunk < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk}")
        need = -(-len(ids) // self.config.block_size)
        if need > self.pool.num_free_blocks:
            raise ValueError(f"{len(ids)} tokens need {need} KV blocks, "
                             f"{self.pool.num_free_blocks} are free")
        blocks = self.pool.get_new_blocks(need)
        try:
            return self.runner.prompt_logprobs(ids, [b.block_id for b in blocks], chunk)
        finally:
            self.pool.free_blocks(reversed(blocks))

    # ---- the step -------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, update: an output for every request that got a
        token or ended. Stale leases expire first; with speculative decoding, running
        decodes propose their drafts before the schedule."""
        self.expire_leases()
        self.loras.sweep()  # unloaded adapters whose last request ended (here, on abort)
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)
        sched = self.scheduler.schedule()
        outputs = [self._output(req, [], "")
                   for req in sched.finished]
        if not sched.scheduled:
            return outputs
        sampled = self.runner.execute(sched)
        deltas: dict[str, tuple[list[int], str]] = {}

        def on_token(req: Request, token: int) -> RequestStatus | None:
            ids, text = deltas.get(req.request_id, ([], ""))
            detok = self._detok[req.request_id]
            deltas[req.request_id] = (ids + [token], text + detok.update([token]))
            if detok.stop_matched is not None:
                return RequestStatus.FINISHED_STOPPED
            if req.grammar is not None:
                if not req.grammar.accept(token):
                    return RequestStatus.FINISHED_CONSTRAINT
                if req.grammar.terminated:
                    return RequestStatus.FINISHED_STOPPED
            return None

        got = self.scheduler.update(sched, sampled, on_token)
        self.loras.sweep()
        if self.spec is not None:
            for s in sampled.values():
                self.spec.record(s.num_drafts, s.num_accepted)
        for req in got:
            ids, text = deltas[req.request_id]
            outputs.append(self._output(req, ids, text))
        for rid, s in sampled.items():  # ended by their constraint, without a token
            if s.dead and rid not in deltas:
                req = next(r for r, _ in sched.scheduled if r.request_id == rid)
                outputs.append(self._output(req, [], ""))
        return outputs

    def _output(self, req: Request, new_ids: list[int], delta: str) -> RequestOutput:
        detok = self._detok[req.request_id]
        if req.status.finished:
            self._detok.pop(req.request_id, None)
        return request_output(req, new_ids, delta, detok, self.kv.block_ids)

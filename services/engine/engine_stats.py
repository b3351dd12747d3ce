"""The counters an engine reports (`LLMEngine.stats()`): the workers' GetStats and
metrics read them."""

from __future__ import annotations

from typing import Any

from .outputs import EngineStats


def engine_stats(engine: Any) -> EngineStats:
    """`engine`: the LLMEngine (untyped here: this module must not import it back)."""
    s, spec = engine.scheduler, engine.spec
    conns = engine.connector_stats()
    pd = conns.get("pd", {})
    return EngineStats(
        num_waiting=len(s.waiting), num_running=len(s.running),
        num_loading=s.num_loading, num_leases=len(s.leases),
        num_blocks=engine.pool.num_blocks - 1, num_free_blocks=engine.pool.num_free_blocks,
        num_blocks_pulled=pd.get("blocks_pulled", 0),
        num_blocks_local=pd.get("blocks_local", 0),
        num_preemptions=s.num_preemptions,
        num_load_failures=s.loads.num_failures,
        num_leases_expired=s.leases.num_expired,
        prefix_cache_queries=engine.kv.num_queries, prefix_cache_hits=engine.kv.num_hits,
        num_prompt_tokens=s.num_prompt_tokens,
        num_generation_tokens=s.num_generation_tokens,
        num_queued_prefill_tokens=queued_prefill_tokens(s),
        num_spec_drafts=spec.num_drafts if spec else 0,
        num_spec_draft_tokens=spec.num_draft_tokens if spec else 0,
        num_spec_accepted_tokens=spec.num_accepted_tokens if spec else 0,
        loras=tuple(engine.loras.names()),
        kv_offload=tuple(sorted(conns.get("offload", {}).items())))


def queued_prefill_tokens(scheduler: Any) -> int:
    """Prompt tokens not computed yet, over the requests waiting and running (a request
    whose KV is still loading counts what the load will not bring: none, once it lands)."""
    return sum(max(0, r.num_prompt_tokens - r.num_computed_tokens)
               for queue in (scheduler.waiting, scheduler.running) for r in queue)

"""Proto messages from and to the engine's types: one place for each conversion. The
wire's SamplingParams becomes the engine's in services/rpc/convert.py
(`sampling_params`, the one seam for every process that reads a request)."""

from __future__ import annotations

from baton.kv_transfer.base import KVLayout
from baton.v1 import generation_pb2 as gen
from baton.worker.v1 import worker_pb2 as wk

from ..common.kv_events import KvEvents
from ..engine.outputs import ModelInfo, RequestOutput
from ..rpc.convert import FINISH, logprobs_messages, set_stop_reason


def kv_events_message(ev: KvEvents, engine_id: str, block_size: int,
                      enabled: bool) -> wk.GetKvEventsResponse:
    """A KvEventLog.read() on the wire: the pool's events, and each tier's by medium."""
    return wk.GetKvEventsResponse(
        engine_id=engine_id, seq=ev.seq, snapshot=ev.snapshot, stored=ev.stored,
        removed=ev.removed, block_size=block_size, enabled=enabled,
        tiers=[wk.KvTierEvents(medium=m, stored=t.stored, removed=t.removed)
               for m, t in ev.tiers.items()])


def layout_message(layout: KVLayout) -> wk.KvLayout:
    return wk.KvLayout(model=layout.model, dtype=layout.dtype, block_size=layout.block_size,
                       num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads,
                       head_dim=layout.head_dim, fingerprint=layout.fingerprint,
                       cache_layout=layout.cache_layout, kv_scales=layout.kv_scales,
                       tp_size=layout.tp_size)


def layout_from_message(msg: wk.KvLayout) -> KVLayout:
    """A peer from before tp_size sends 0: it runs one rank."""
    return KVLayout(model=msg.model, dtype=msg.dtype, block_size=msg.block_size,
                    num_layers=msg.num_layers, num_kv_heads=msg.num_kv_heads,
                    head_dim=msg.head_dim, cache_layout=msg.cache_layout,
                    kv_scales=msg.kv_scales, tp_size=msg.tp_size or 1)


def model_info_message(info: ModelInfo) -> gen.ModelInfo:
    return gen.ModelInfo(model=info.model, architecture=info.architecture,
                         max_model_len=info.max_model_len, vocab_size=info.vocab_size,
                         eos_token_ids=list(info.eos_token_ids), block_size=info.block_size,
                         dtype=info.dtype, family=info.family,
                         served_model_name=info.served_model_name)


def timings_message(out: RequestOutput) -> gen.Timings:
    return gen.Timings(queue_s=out.queue_time or 0.0, prefill_s=out.prefill_time or 0.0,
                       kv_transfer_s=out.transfer_time or 0.0)



def delta_message(out: RequestOutput) -> gen.TokenDelta:
    """This step of a request as the wire's one token delta (every service streams it)."""
    delta = gen.TokenDelta(token_ids=out.new_token_ids, text=out.new_text,
                           finish_reason=FINISH[out.finish_reason])
    if out.logprobs and out.new_token_ids:
        delta.logprobs.extend(logprobs_messages(out.logprobs[-len(out.new_token_ids):]))
    set_stop_reason(delta, out.stop_reason)
    return delta

"""A request's RequestOutput at a step: its delta, and at its end why it ended and its
timings (a prefilled one: the blocks held and the lease that holds them)."""

from __future__ import annotations

from collections.abc import Callable

from .detokenizer import IncrementalDetokenizer
from .outputs import RequestOutput
from .request import Request, RequestStatus


def request_output(req: Request, new_ids: list[int], delta: str,
                   detok: IncrementalDetokenizer,
                   block_ids: Callable[[str], list[int]]) -> RequestOutput:
    status = req.status
    prefilled = status == RequestStatus.PREFILLED
    if status.finished and not prefilled and detok.stop_matched is None:
        delta += detok.flush()
    stop_reason = None
    if status == RequestStatus.FINISHED_STOPPED:
        last = req.token_ids[-1]
        stop_reason = detok.stop_matched or (last if last in req.stop_ids else None)
    t_sched, t_first = req.scheduled_time, req.first_token_time
    return RequestOutput(
        request_id=req.request_id,
        prompt_token_ids=req.prompt_token_ids,
        token_ids=req.output_token_ids,
        text=detok.text,
        new_token_ids=new_ids,
        new_text=delta,
        finish_reason=status.finish_reason,
        stop_reason=stop_reason,
        logprobs=list(req.logprobs) if req.params.logprobs is not None else None,
        num_cached_tokens=max(req.num_cached_tokens, 0),
        num_preemptions=req.num_preemptions,
        error=req.error,
        kv_load_error=req.kv_load_error,
        kv_block_ids=block_ids(req.request_id) if prefilled else None,
        kv_lease_id=req.lease_id if prefilled else None,
        queue_time=None if t_sched is None else t_sched - req.arrival_time,
        prefill_time=None if t_first is None or t_sched is None else t_first - t_sched,
        transfer_time=(None if req.load_end is None or req.load_start is None
                       else req.load_end - req.load_start),
    )

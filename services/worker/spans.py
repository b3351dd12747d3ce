"""A worker's part of a request's trace, recorded from the engine's own timings when the
request's output says them (the engine thread never touches tracing)."""

from __future__ import annotations

import time

from opentelemetry.context import Context

from ..engine.outputs import RequestOutput
from ..rpc import tracing


def prompt(out: RequestOutput, parent: Context) -> None:
    """Queue (arrival to first scheduled), then prefill (to the first token), ending now."""
    if out.queue_time is None or out.prefill_time is None:
        return
    end = time.monotonic()
    scheduled = end - out.prefill_time
    tracing.record("queue", parent, scheduled - out.queue_time, scheduled)
    tracing.record("prefill", parent, scheduled, end,
                   **{"baton.cached_tokens": out.num_cached_tokens,
                      "baton.prompt_tokens": len(out.prompt_token_ids)})


def pull(out: RequestOutput, parent: Context) -> None:
    """The decode worker's pull of the prompt's KV, ending about now."""
    if out.transfer_time:
        end = time.monotonic()
        tracing.record("kv_pull", parent, end - out.transfer_time, end,
                       **{"baton.cached_tokens": out.num_cached_tokens})

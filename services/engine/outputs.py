"""What the engine returns for a request: at each step (deltas) and at the end."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # all output tokens so far
    text: str  # all output text so far (cut at a stop string)
    new_token_ids: list[int] = field(default_factory=list)  # this step's delta
    new_text: str = ""  # this step's text delta
    finish_reason: str | None = None  # "stop", "length" or "abort"; None while going on
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    logprobs: list[dict[int, float]] | None = None  # per output token: sampled + top N
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    error: str | None = None  # why an aborted request failed (e.g. its KV transfer)
    # Prefill role: set on the output that hands the request off, with the blocks held.
    kv_block_ids: list[int] | None = None
    # Seconds: waiting before first scheduled, first scheduled to first token, remote KV
    # load. None where they do not apply (yet).
    queue_time: float | None = None
    prefill_time: float | None = None
    transfer_time: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

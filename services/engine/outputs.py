"""What the engine returns: per request at each step (deltas and the end), the token each
sampling row drew, and the engine's own figures (stats)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..common.finish import FinishReason


@dataclass
class SampledTokens:
    """What one request drew in a step: without drafts, one token. With n draft tokens
    verified, the accepted drafts and then one token sampled by the target model (so
    1 to n + 1 tokens). Empty, with `dead`, when its constraint allowed no token."""

    token_ids: list[int]
    logprobs: list[dict[int, float]] | None = None  # per token: it and the top N, if asked
    num_drafts: int = 0
    dead: bool = False

    @property
    def num_accepted(self) -> int:
        return max(0, len(self.token_ids) - 1) if self.num_drafts else 0


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # all output tokens so far
    text: str  # all output text so far (cut at a stop string)
    new_token_ids: list[int] = field(default_factory=list)  # this step's delta
    new_text: str = ""  # this step's text delta
    finish_reason: FinishReason | None = None  # None while it goes on
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    logprobs: list[dict[int, float]] | None = None  # per output token: sampled + top N
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    error: str | None = None  # why an aborted request failed (e.g. its KV transfer)
    kv_load_error: str | None = None  # decode role: its pull failed; it was recomputed here
    engine_failed: bool = False  # the engine itself failed (the request may go elsewhere)
    # Prefill role: set on the output that hands the request off: the blocks held, and
    # the lease they are held under.
    kv_block_ids: list[int] | None = None
    kv_lease_id: int | None = None
    # Seconds: waiting before first scheduled, first scheduled to first token, remote KV
    # load. None where they do not apply (yet).
    queue_time: float | None = None
    prefill_time: float | None = None
    transfer_time: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def handed_off(self) -> bool:
        """Prefill role: the request goes on elsewhere; its blocks are held for that."""
        return self.kv_block_ids is not None


@dataclass(frozen=True)
class EngineStats:
    """Load and memory figures, for routing and for the pool invariant in tests: after
    the last request ends, num_free_blocks == num_blocks and every count is 0."""

    num_waiting: int = 0
    num_running: int = 0
    num_loading: int = 0  # decode role: requests whose KV is being pulled
    num_leases: int = 0  # prefill role: requests whose KV is held for a decode worker
    num_blocks: int = 0
    num_free_blocks: int = 0
    num_blocks_pulled: int = 0
    num_blocks_local: int = 0
    num_preemptions: int = 0
    num_load_failures: int = 0
    num_leases_expired: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up
    prefix_cache_hits: int = 0  # of which found cached
    num_prompt_tokens: int = 0  # prompt tokens computed here, since start
    num_generation_tokens: int = 0  # tokens sampled here, since start
    num_queued_prefill_tokens: int = 0  # prompt tokens of waiting and running requests to compute
    # Speculative decoding, since start: requests-steps that carried drafts, the draft
    # tokens proposed, and those accepted. Acceptance rate = accepted / draft tokens;
    # mean accepted length = 1 + accepted / drafts (tokens per verified step).
    num_spec_drafts: int = 0
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    loras: tuple[str, ...] = ()  # the LoRA adapters it serves (--enable-lora)
    # The offload tiers' counters (kv_connector/offload.py): "<medium>_hits" (blocks
    # loaded), "_load_bytes", "_saves", "_save_bytes", "_evictions", and the files
    # rejected, "_corrupt", "_forged", "_foreign"; "load_misses", "save_dropped". Empty
    # without tiers.
    kv_offload: tuple[tuple[str, int], ...] = ()

    @property
    def spec_acceptance_rate(self) -> float:
        return self.num_spec_accepted_tokens / max(1, self.num_spec_draft_tokens)

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens per verified request-step: the accepted drafts and the model's own."""
        return 1 + self.num_spec_accepted_tokens / max(1, self.num_spec_drafts)

    @property
    def idle(self) -> bool:
        return (self.num_waiting == self.num_running == self.num_loading
                == self.num_leases == 0)


@dataclass(frozen=True)
class ModelInfo:
    """What a worker tells the router about its model."""

    model: str
    architecture: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    block_size: int
    dtype: str
    family: str = "llama"  # services/engine/models/<family>
    served_model_name: str = ""  # the model's name in the API (--served-model-name)

"""A request as the engine tracks it: its tokens, how many have KV, and its state."""

from __future__ import annotations

import enum
import time

import torch

from baton.kv_transfer.base import KVHandle

from ..common.block_hash import extra_keys
from ..common.finish import FinishReason
from ..common.sampling_params import SamplingParams
from .ngram_index import NgramIndex
from .structured_output import GrammarState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_KV = "waiting_for_kv"  # decode role: blocks allocated, remote KV arriving
    RUNNING = "running"
    PREFILLED = "prefilled"  # prefill role: first token out, blocks held under a lease
    FINISHED_STOPPED = FinishReason.STOP
    FINISHED_LENGTH = FinishReason.LENGTH
    FINISHED_ABORTED = FinishReason.ABORT
    FINISHED_CONSTRAINT = FinishReason.CONSTRAINT

    @property
    def finish_reason(self) -> FinishReason | None:
        """Why the request ended; None while it goes on, and once PREFILLED (it goes on
        elsewhere)."""
        return self.value if isinstance(self.value, FinishReason) else None

    @property
    def finished(self) -> bool:
        """Done here: ended, or handed off with its first token."""
        return self is RequestStatus.PREFILLED or self.finish_reason is not None


class Request:
    """`token_ids` is prompt + output. The engine's one rule: `num_computed_tokens` (tokens
    whose KV is in the cache) catches up to `num_tokens`; when it does, a token is sampled.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: tuple[int, ...], priority: int = 0,
                 arrival_time: float | None = None, cache_salt: str | None = None,
                 lora_name: str | None = None):
        self.request_id = request_id
        self.params = params
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.num_preemptions = 0
        self.stop_ids = frozenset(params.stop_token_ids)
        self.eos_ids = frozenset(() if params.ignore_eos else eos_token_ids)
        self.min_tokens_ban = self.eos_ids | self.stop_ids  # banned under min_tokens
        # bad_words as token id sequences (the engine tokenizes them): the last id of each
        # is banned where the output ends with the others.
        self.bad_words_ids: tuple[tuple[int, ...], ...] = ()
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)
        self.logprobs: list[dict[int, float]] = []
        # The LoRA adapter it runs, as the engine binds it (services/lora/registry.py: the
        # adapter's name, or with new weights under that name, the name and their
        # fingerprint); None: the base model.
        self.lora_name = lora_name or None
        self.lora_blocked_since: float | None = None  # first refused for max_loras (scheduler)
        # Prefix cache: requests with different salts, or different adapters, never share
        # a block (block_hash.extra_keys).
        self.hash_extra = extra_keys(cache_salt or "", lora_name or "")
        self.block_hashes: list[bytes] = []  # one per full block of token_ids, chained
        self.num_cached_tokens = -1  # prompt tokens found cached at first admission
        # Disaggregation: hold the KV after the first token (prefill role; `lease_id` once
        # held), or take the prompt's KV from a remote engine (decode role).
        self.kv_hold = False
        self.lease_id: int | None = None
        self.remote: KVHandle | None = None
        self.kv_load_error: str | None = None  # why its pull failed, if it was recomputed
        # Connectors whose load of it timed out: not asked again (their backlog, if that
        # is why, would only grow), and its blocks recomputed instead.
        self.kv_timed_out: set[str] = set()
        self.error: str | None = None  # why an aborted request failed, if it did
        # Structured output: the matcher of its constraint (services/engine/
        # structured_output.py), in the state the output so far leaves it.
        self.grammar: GrammarState | None = None
        # Speculative decoding: draft tokens to verify in the next step (never part of
        # token_ids: only those the target model accepts are appended), and the n-gram
        # index over token_ids that proposes them.
        self.spec_token_ids: list[int] = []
        self.ngram_index: NgramIndex | None = None
        # Timings (monotonic seconds): first scheduled, first token, remote KV load.
        self.scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.load_start: float | None = None
        self.load_end: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def sort_key(self, priority_policy: bool) -> tuple:
        """Smaller runs first: (priority, arrival) under the priority policy, else arrival."""
        return (self.priority, self.arrival_time) if priority_policy else (self.arrival_time,)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, {self.status.name})")

"""Per-request sampling and stopping parameters, validated on construction."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from baton.services.common import constraint_limits
from baton.services.common.limits import (
    STOP_CEILING,
    STOP_CHARS_CEILING,
    STOP_TOKEN_IDS_CEILING,
    check_ceiling,
)

_EPS = 1e-5

# The kinds of structured output, as vLLM's StructuredOutputsParams names them.
STRUCTURED_KINDS = ("json", "json_object", "regex", "grammar", "choice")


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the output: the engine masks every token that cannot continue it.

    kind "json": `spec` is a JSON schema (as JSON text); "json_object": any JSON object
    (`spec` empty); "regex": the output full-matches `spec`; "grammar": `spec` is an EBNF
    grammar in GBNF form (root rule `root`); "choice": the output is one of `choices`.
    Whether the engine can compile it is checked there (a ValueError naming the problem).
    """

    kind: str
    spec: str = ""
    choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "choices", tuple(self.choices))
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured output kind must be one of {STRUCTURED_KINDS}, "
                             f"got {self.kind!r}")
        constraint_limits.check(self.kind, self.spec, self.choices)  # before any parse
        if self.kind == "choice":
            if not self.choices or any(not isinstance(c, str) or not c for c in self.choices):
                raise ValueError("structured output choice: needs one or more non-empty "
                                 "strings")
        elif self.kind != "json_object" and not (isinstance(self.spec, str) and self.spec):
            raise ValueError(f"structured output {self.kind}: empty")
        if self.kind == "json":
            try:
                schema = json.loads(self.spec)
            except ValueError as e:
                raise ValueError(f"structured output json: not valid JSON ({e})") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("structured output json: a schema must be an object")

    @property
    def key(self) -> tuple:
        """What identifies the compiled grammar (its cache key)."""
        return (self.kind, self.spec, self.choices)


@dataclass(frozen=True)
class SamplingParams:
    """What to sample and when to stop. Every bad value raises `ValueError` naming it.

    temperature 0 means greedy. top_k -1 and top_p 1 and min_p 0 disable those filters.
    Penalties follow vLLM: repetition_penalty (1 = off) scales the logits of every token
    seen in the prompt or output (divide if positive, multiply if negative);
    presence_penalty and frequency_penalty (0 = off) subtract from the logits of tokens
    already in the output, once and per occurrence.
    `structured` constrains the output (JSON schema, regex, grammar, choice).
    `logprobs=N` returns the sampled token's logprob and the top N (of the raw model
    distribution, before any penalty or temperature).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        # Accept lists from callers but store tuples, so the object stays hashable/frozen.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        # Counted first: every later check (and the engine's stop matcher) is per item.
        check_ceiling("stop", len(self.stop), STOP_CEILING, "strings")
        check_ceiling("stop_token_ids", len(self.stop_token_ids), STOP_TOKEN_IDS_CEILING,
                      "ids")
        longest = max((len(s) for s in self.stop if isinstance(s, str)), default=0)
        check_ceiling("stop strings", longest, STOP_CHARS_CEILING, "characters")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k != -1):
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty!r}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty!r}"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs!r}")
        if any(not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty, got {self.stop!r}")
        if any((not isinstance(t, int)) or t < 0 for t in self.stop_token_ids):
            raise ValueError(
                f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}"
            )
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise ValueError(f"structured must be a StructuredOutput, got {self.structured!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < _EPS

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

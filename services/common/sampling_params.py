"""Per-request sampling and stopping parameters, validated on construction."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from . import constraint_limits
from .errors import shown
from .limits import check_ceilings

_EPS = 1e-5

# The kinds of structured output, as vLLM's StructuredOutputsParams names them.
STRUCTURED_KINDS = ("json", "json_object", "regex", "grammar", "choice")
MAX_START_AFTER = 16  # token ids of a constraint's start marker ("</think>" takes 1 to 4)


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the output: the engine masks every token that cannot continue it.

    kind "json": `spec` is a JSON schema (as JSON text); "json_object": any JSON object
    (`spec` empty); "regex": the output full-matches `spec`; "grammar": `spec` is an EBNF
    grammar in GBNF form (root rule `root`); "choice": the output is one of `choices`.
    Whether the engine can compile it is checked there (a ValueError naming the problem).
    `start_after`: token ids that, once the output holds them in a row (a reasoning
    model's end of thinking), start the constraint; the output up to them is free.
    """

    kind: str
    spec: str = ""
    # Any sequence (a wire message's list is taken as it is); a tuple once made.
    choices: Sequence[str] = ()
    start_after: Sequence[int] = ()

    def __post_init__(self) -> None:
        # Counted before a tuple is built of them (a wire message's lists are taken as
        # they are), and before any parse.
        if len(self.start_after) > MAX_START_AFTER:
            raise ValueError(f"structured output start_after: at most {MAX_START_AFTER} "
                             f"token ids, got {len(self.start_after)}")
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured output kind must be one of {STRUCTURED_KINDS}, "
                             f"got {shown(self.kind)}")
        constraint_limits.check(self.kind, self.spec, self.choices)
        object.__setattr__(self, "choices", tuple(self.choices))
        object.__setattr__(self, "start_after", tuple(self.start_after))
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0
               for t in self.start_after):
            raise ValueError(f"structured output start_after: token ids are ints >= 0, got "
                             f"{shown(self.start_after)}")
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
        """What identifies the compiled grammar (its cache key): `start_after` is the
        matcher's, not the grammar's."""
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
    `min_tokens`: until that many tokens are out, EOS and stop_token_ids cannot be
    sampled and stop strings do not match (a stop may end the output from the token
    after them on, as vLLM). `logit_bias`: (token id, bias in [-100, 100]) pairs (a dict
    is taken too), added to the logits after the penalties. `bad_words`: words never
    produced: each is tokenized by the engine (as written and with a leading space), and
    a word's last token is banned where the output ends with its other tokens.
    `logprobs=N` returns the sampled token's logprob and the top N (of the raw model
    distribution, before any penalty, bias, ban or temperature).
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
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    bad_words: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("stop", "bad_words"):
            if isinstance(getattr(self, name), str):
                object.__setattr__(self, name, (getattr(self, name),))
        # Counted first, before a tuple is built of them (a wire message's lists are taken
        # as they are): every later check (and the engine's stop matcher) is per item.
        check_ceilings("sampling", self)
        # Stored as tuples, so the object stays hashable and frozen.
        for name in ("stop", "bad_words", "stop_token_ids"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        bias = self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(
            bias.items() if isinstance(bias, Mapping) else bias))
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got "
                             f"{shown(self.max_tokens)}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got "
                             f"{shown(self.min_tokens)}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be at most max_tokens "
                             f"({self.max_tokens})")
        self._check_logit_bias()
        if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            raise ValueError(f"bad_words must be non-blank strings, got "
                             f"{shown(self.bad_words)}")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {shown(value)}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k != -1):
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {shown(self.top_k)}")
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
            raise ValueError(f"logprobs must be in [0, 20], got {shown(self.logprobs)}")
        if any(not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty, got {shown(self.stop)}")
        if any((not isinstance(t, int)) or t < 0 for t in self.stop_token_ids):
            raise ValueError(
                f"stop_token_ids must be non-negative ints, got {shown(self.stop_token_ids)}"
            )
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {shown(self.seed)}")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise ValueError(f"structured must be a StructuredOutput, got "
                             f"{shown(self.structured)}")

    def _check_logit_bias(self) -> None:
        """Pairs of a token id and a finite bias in [-100, 100], each id once; stored
        sorted by id (so equal requests compare equal)."""
        pairs = []
        for pair in self.logit_bias:
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise ValueError(f"logit_bias must map token ids to biases, got "
                                 f"{shown(pair)}")
            token, bias = pair
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got "
                                 f"{shown(token)}")
            if (isinstance(bias, bool) or not isinstance(bias, (int, float))
                    or not -100.0 <= bias <= 100.0):  # NaN fails this too
                raise ValueError(f"logit_bias of token {token} must be a number in "
                                 f"[-100, 100], got {shown(bias)}")
            pairs.append((token, float(bias)))
        pairs.sort()
        dup = next((a for (a, _), (b, _) in zip(pairs, pairs[1:], strict=False) if a == b),
                   None)
        if dup is not None:
            raise ValueError(f"logit_bias gives token {dup} more than one bias")
        object.__setattr__(self, "logit_bias", tuple(pairs))

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


# The value of each field a request leaves unset (and the model's generation_config.json
# does not set), spelled once: on SamplingParams' fields above. The proto's comments say
# them in prose (a test compares); vLLM's completions default max_tokens is the same 16.
DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(SamplingParams)}

"""How big one request may be. Torch-free: the router bounds a request with `Limits`
(flags, so an operator can tune them) before any per-item work; the engine holds every
request to the fixed ceilings below, so a caller that reaches a worker directly cannot
get around the router's bounds either. A count over its bound raises `OverLimit`, a
ValueError naming the field ("field: ..."): the server shell answers INVALID_ARGUMENT,
the HTTP API 400 with that field as `param`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


class OverLimit(ValueError):
    """A request over one of its bounds; the message starts with the field it names."""


# The engine's own ceilings: generous, never configurable.
STOP_CEILING = 128  # stop strings per request
STOP_CHARS_CEILING = 512  # characters per stop string
STOP_TOKEN_IDS_CEILING = 1024
LOGIT_BIAS_CEILING = 300  # logit_bias entries (OpenAI's own bound)
BAD_WORDS_CEILING = 128  # bad_words per request
BAD_WORD_CHARS_CEILING = 512  # characters per bad word
CACHE_SALT_CEILING = 4096  # characters (the router may prefix a caller's namespace)
REQUEST_ID_CEILING = 1024  # characters (the router adds a unique suffix)
ROUTER_ID_CHARS = 64  # room for the ids the router makes itself (OpenAI's choices)


def _limit(default: int, unit: str, ceiling: int | None = None):
    """A bound, and the most the router may allow (room left for what it adds)."""
    return field(default=default, metadata={"unit": unit, "ceiling": ceiling})


@dataclass(frozen=True)
class Limits:
    """The router's bounds on one request (gRPC Generate and Tokenize, and each OpenAI
    body). Counts are checked before anything is built per item."""

    max_prompts: int = _limit(256, "prompts")  # per completions request
    max_n: int = _limit(128, "choices")  # per prompt
    max_messages: int = _limit(2048, "messages")  # per chat
    max_prompt_chars: int = _limit(4 * 1024 * 1024, "characters")  # text and contents
    max_prompt_token_ids: int = _limit(1024 * 1024, "token ids")  # over every prompt
    max_stop: int = _limit(32, "stop strings", STOP_CEILING)
    max_stop_chars: int = _limit(256, "characters", STOP_CHARS_CEILING)  # per stop string
    max_stop_token_ids: int = _limit(256, "stop token ids", STOP_TOKEN_IDS_CEILING)
    max_cache_salt_chars: int = _limit(1024, "characters", CACHE_SALT_CEILING // 2)
    max_request_id_chars: int = _limit(256, "characters", REQUEST_ID_CEILING // 2)
    max_user_chars: int = _limit(256, "characters")
    # What one OpenAI request's answer may hold: each prompt's n x max_tokens x (1 +
    # top_logprobs) tokens and logprobs, each rendered on the router.
    max_answer_tokens: int = _limit(1024 * 1024, "tokens and logprobs")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value, ceiling = getattr(self, f.name), f.metadata["ceiling"]
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{f.name} must be an integer >= 1, got {value!r}")
            if ceiling is not None and value > ceiling:
                raise ValueError(f"{f.name} must be at most {ceiling} (what the engine "
                                 f"takes, less what the router adds), got {value!r}")
        if self.max_request_id_chars < ROUTER_ID_CHARS:
            raise ValueError(f"max_request_id_chars must be at least {ROUTER_ID_CHARS} (the "
                             f"ids the router makes), got {self.max_request_id_chars!r}")

    def check(self, name: str, got: int, where: str, more: bool = False) -> None:
        """`check_bound` against the limit `name` (its flag named in the message)."""
        bound = getattr(self, name)
        if got > bound:
            unit = next(f for f in dataclasses.fields(self) if f.name == name).metadata["unit"]
            check_bound(where, got, bound, unit, more, flag=name.replace("_", "-"))


def check_bound(where: str, got: int, bound: int, unit: str, more: bool = False,
                flag: str | None = None) -> None:
    """OverLimit naming the field `where` when `got` is over `bound` (a `Limits` field,
    or one of the engine's fixed bounds; `more`: counting stopped past it, so `got` is
    only a lower bound)."""
    if got > bound:
        what = "more than" if more else f"{got}, over"
        tail = f" (--{flag})" if flag else ""
        raise OverLimit(f"{where}: {what} the limit of {bound} {unit}{tail}")


def check_ceiling(name: str, got: int, ceiling: int, unit: str) -> None:
    """ValueError naming `name` when `got` is over the engine's `ceiling`."""
    if got > ceiling:
        raise ValueError(f"{name} may hold at most {ceiling} {unit}; got {got}")

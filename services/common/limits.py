"""How big one request may be, declared once: `TABLE` holds a `Bound` per bounded field,
and every path reads it. Torch-free.

    the router   `Limits` (its fields and flags are the table's rows with a default, so an
                 operator can tune them) bounds a request before any per-item work: on the
                 gRPC wire bytes (router/wire.py), in an OpenAI body (router/openai/body.py)
                 and once parsed (router/intake.py)
    the engine   holds every request to the rows' ceilings (`check_ceilings`, from
                 SamplingParams and the engine's add_request), so a caller that reaches a
                 worker directly cannot get around the router's bounds either

A row's `wire` and `body` name the fields the router counts the same way everywhere; a
row without them (prompts, messages, token ids in all, ...) is counted by code of its
own (the wire walk's chat and token ids, the body's prompts), which reads its bound here.
A count over its bound raises `OverLimit`, a ValueError naming the field ("field: ..."):
the server shell answers INVALID_ARGUMENT, the HTTP API 400 with that field as `param`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

ITEMS, CHARS = "items", "characters"  # how a row counts (Bound.count)
ROUTER_ID_CHARS = 64  # room for the ids the router makes itself (OpenAI's choices)
# A chat's fixed bounds (router/chat.py checks them; its tool schemas, arguments and
# reasoning count as prompt characters).
MAX_TOOLS = 128  # per request, as OpenAI bounds them
MAX_TOOL_CALLS = 2048  # in the messages of one chat
MAX_TEMPLATE_KWARGS_CHARS = 16384


class OverLimit(ValueError):
    """A request over one of its bounds; the message starts with the field it names."""


@dataclass(frozen=True)
class Bound:
    """One bounded field of a request.

    `count`: ITEMS, the items of a repeated field (a map's entries; a lone string in a
    body is one), or CHARS, the characters of a string (of each item of a repeated one).
    `wire`: its path in GenerateRequest ("sampling.stop"); `body`: its OpenAI body key.
    `default`: the router's bound, a `Limits` field and flag (--max-stop); None: the
    engine's `ceiling` alone bounds it. `ceiling`: what the engine takes (None: nothing
    of its own); the router may allow at most ceiling // `room` (room for what it adds).
    `engine`: (name, unit) in the engine's message, where they differ from the router's.
    """

    name: str
    unit: str
    help: str = ""
    count: str = ITEMS
    wire: str | None = None
    body: str | None = None
    default: int | None = None
    ceiling: int | None = None
    room: int = 1
    engine: tuple[str, str] | None = None

    @property
    def flag(self) -> str | None:
        return self.name.replace("_", "-") if self.default is not None else None

    @property
    def most(self) -> int | None:
        """The most the router may allow."""
        return None if self.ceiling is None else self.ceiling // self.room


TABLE = (
    Bound("max_prompts", "prompts", "prompts in one completions request", default=256),
    Bound("max_n", "choices", "choices (n) per prompt", default=128),
    Bound("max_messages", "messages", "messages in one chat", default=2048),
    Bound("max_prompt_chars", "characters",
          "characters of prompt text and message contents in one request", CHARS,
          wire="text", default=4 * 1024 * 1024),
    Bound("max_prompt_token_ids", "token ids", "prompt token ids in one request",
          default=1024 * 1024),
    Bound("max_stop", "stop strings", "stop strings in one request", wire="sampling.stop",
          body="stop", default=32, ceiling=128, engine=("stop", "strings")),
    Bound("max_stop_chars", "characters", "characters of one stop string", CHARS,
          wire="sampling.stop", body="stop", default=256, ceiling=512,
          engine=("stop strings", "characters")),
    Bound("max_stop_token_ids", "stop token ids", "stop token ids in one request",
          wire="sampling.stop_token_ids", body="stop_token_ids", default=256, ceiling=1024,
          engine=("stop_token_ids", "ids")),
    # The router may prefix a caller's namespace to a salt, and adds a suffix to an id.
    Bound("max_cache_salt_chars", "characters", "characters of a cache_salt", CHARS,
          wire="cache_salt", body="cache_salt", default=1024, ceiling=4096, room=2),
    Bound("max_request_id_chars", "characters", "characters of a request_id", CHARS,
          wire="request_id", default=256, ceiling=1024, room=2),
    Bound("max_user_chars", "characters", "characters of the OpenAI `user` field", CHARS,
          body="user", default=256),
    # Each prompt's n x max_tokens x (1 + top_logprobs) tokens and logprobs, each
    # rendered on the router (router/openai/protocol.py).
    Bound("max_answer_tokens", "tokens and logprobs",
          "tokens and logprobs one OpenAI request's answer may hold: n x max_tokens x (1 + "
          "top_logprobs) over its prompts (max_tokens unset in a chat: the model's "
          "max_new_tokens, else max_model_len)",
          default=1024 * 1024),
    # The engine's alone (OpenAI's own bound on logit_bias).
    Bound("logit_bias", "entries", wire="sampling.logit_bias", body="logit_bias",
          ceiling=300),
    Bound("bad_words", "words", wire="sampling.bad_words", body="bad_words", ceiling=128),
    Bound("bad_word_chars", "characters a word", count=CHARS, wire="sampling.bad_words",
          body="bad_words", ceiling=512, engine=("bad_words", "characters a word")),
)
BOUNDS = {b.name: b for b in TABLE}
assert len(BOUNDS) == len(TABLE), "two rows of one name"


def count(bound: Bound, value) -> int:
    """`value` (a list, map, string or wire container) counted as `bound` counts it."""
    if bound.count == ITEMS:
        return 1 if isinstance(value, str) else len(value)
    if isinstance(value, str):
        return len(value)
    return max((len(v) for v in value if isinstance(v, str)), default=0)


def _ceilings() -> dict[str, list[tuple[Bound, str, int]]]:
    """The scope of a wire path ("" or "sampling") -> its rows with a ceiling: (row, the
    field's name there, the ceiling)."""
    out: dict[str, list[tuple[Bound, str, int]]] = {}
    for b in TABLE:
        if b.ceiling is not None and b.wire is not None:
            scope, _, name = b.wire.rpartition(".")
            out.setdefault(scope, []).append((b, name, b.ceiling))
    return out


_CEILINGS = _ceilings()


def check_ceilings(scope: str, values) -> None:
    """The engine's ceilings on the fields at `scope` of the wire's paths ("": the
    request's own, "sampling": its sampling values), read from `values` (an object or a
    mapping) by their names: ValueError naming the first field over its ceiling."""
    for b, name, ceiling in _CEILINGS.get(scope, ()):
        got = count(b, values[name] if isinstance(values, Mapping) else getattr(values, name))
        if got > ceiling:
            what, unit = b.engine or (name, b.unit)
            raise ValueError(f"{what} may hold at most {ceiling} {unit}; got {got}")


def _post_init(self) -> None:
    for b in TABLE:
        if b.default is None:
            continue
        value = getattr(self, b.name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{b.name} must be an integer >= 1, got {value!r}")
        if b.most is not None and value > b.most:
            raise ValueError(f"{b.name} must be at most {b.most} (what the engine takes, "
                             f"less what the router adds), got {value!r}")
    if self.max_request_id_chars < ROUTER_ID_CHARS:
        raise ValueError(f"max_request_id_chars must be at least {ROUTER_ID_CHARS} (the "
                         f"ids the router makes), got {self.max_request_id_chars!r}")


def _bound(self, name: str) -> int:
    """The bound of row `name`: its `Limits` field, else the engine's ceiling."""
    b = BOUNDS[name]
    if b.default is not None:
        return getattr(self, name)
    assert b.ceiling is not None  # a row bounds by a flag, a ceiling, or both
    return b.ceiling


def _check(self, name: str, got: int, where: str, more: bool = False) -> None:
    """`check_bound` against row `name` (its flag, if it has one, named in the message)."""
    b = BOUNDS[name]
    check_bound(where, got, self.bound(name), b.unit, more, flag=b.flag)


if TYPE_CHECKING:
    class Limits:
        """What a checker knows of the class made below from TABLE: a frozen record of
        int bounds, one per row with a default, by that row's name."""

        def __init__(self, **bounds: int) -> None: ...
        def __getattr__(self, name: str) -> int: ...
        def bound(self, name: str) -> int: ...
        def check(self, name: str, got: int, where: str, more: bool = False) -> None: ...

else:
    Limits = dataclasses.make_dataclass(
        "Limits", [(b.name, int, field(default=b.default)) for b in TABLE if b.default is not None],
        frozen=True, namespace={
            "__doc__": "The router's bounds on one request (gRPC Generate and Tokenize, and "
                       "each OpenAI body): a field per row of TABLE with a default. Counts are "
                       "checked before anything is built per item.",
            "__post_init__": _post_init, "bound": _bound, "check": _check})
    Limits.__module__ = __name__


def check_bound(where: str, got: int, bound: int, unit: str, more: bool = False,
                flag: str | None = None) -> None:
    """OverLimit naming the field `where` when `got` is over `bound` (a `Limits` field,
    or one of the engine's fixed bounds; `more`: counting stopped past it, so `got` is
    only a lower bound)."""
    if got > bound:
        what = "more than" if more else f"{got}, over"
        tail = f" (--{flag})" if flag else ""
        raise OverLimit(f"{where}: {what} the limit of {bound} {unit}{tail}")


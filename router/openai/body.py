"""An OpenAI request body, from bytes to its model, counted before anything is built per
item. It runs on the intake's parse threads (not the tokenizer's), and never holds the
interpreter for long, so the event loop (health, every other stream) keeps answering:

    bytes ──> JSON      C's json when the body holds few brackets and commas; otherwise
                        a parse that counts as it goes and stops past the limits (a
                        million prompts or chat messages cost it the first few thousand)
          ──> counts    prompts, choices, messages, characters, token ids (and each
                        prompt's against max_model_len, once known), stop strings,
                        cache_salt, user, a constraint's choices (guided_choice,
                        structured_outputs.choice), logit_bias, bad_words and JSON
                        values: each over its limit is a 400 naming the field
          ──> model     pydantic, on a body now known to be small enough
"""

from __future__ import annotations

import json
from collections.abc import Callable

# CPython's own pure-Python JSON parser pieces (what json.loads runs without its C
# scanner), documented in its source, not in the type stubs.
from json.decoder import JSONArray, JSONObject  # pyright: ignore[reportAttributeAccessIssue]
from json.scanner import py_make_scanner  # pyright: ignore[reportAttributeAccessIssue]
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from baton.services.common import constraint_limits
from baton.services.common.limits import ITEMS, TABLE, Limits, OverLimit, check_bound, count
from baton.services.rpc.errors import InvalidArgument

from .structured import GUIDED

CHEAP = 4096  # up to this many "{" and "[", and 32 times as many ",": C's json at once
SLICE = 1 << 20  # bytes counted at a time (the interpreter switches threads between)
CHOICES = "choices"  # the engine's fixed bound on a constraint's choices (MAX_CHOICES)
# In the ASGI scope (the app's Guard puts them there): the caller's API key as
# security.key_id, and the body's bytes held against the unparsed budget (unparsed.py).
KEY_ID, HELD = "baton.key_id", "baton.held"
PROMPT_IDS = "prompt ids"  # one of several prompts of token ids: max_model_len alone
# The arrays a body may hold that have a limit, by the keys down to them, and what each
# counts against: a row of the limits' TABLE, or CHOICES.
ARRAY_LIMITS = {("messages",): "max_messages", ("prompt",): "max_prompts",
                ("guided_choice",): CHOICES, ("structured_outputs", "choice"): CHOICES,
                **{(row.body,): row.name for row in TABLE if row.body and row.count == ITEMS}}
# A chat message's strings, besides its content and tool calls, that a template renders.
MESSAGE_STRINGS = ("name", "reasoning_content", "tool_call_id")
# The members that hold a structured-output constraint: a constraint's text is bounded
# (MAX_CONSTRAINT_CHARS), and every JSON value in it takes at least one character of it.
CONSTRAINT_KEYS = frozenset({"response_format", "structured_outputs", *GUIDED})


Body = TypeVar("Body", bound=BaseModel)


def parse_body(raw: bytes | list[bytes], kind: type[Body], limits: Limits,
               max_model_len: int | None = None) -> Body:
    """The body (or its chunks) as `kind`, or a ValueError naming the first field over a
    limit (OverLimit) or malformed (InvalidArgument). A prompt of token ids that cannot
    fit `max_model_len` (None: not known yet) is refused as it is counted."""
    data = load_json(raw if isinstance(raw, bytes) else b"".join(raw), limits, max_model_len)
    if not isinstance(data, dict):
        raise InvalidArgument("body: must be a JSON object")
    check_counts(data, limits, max_model_len)
    if isinstance(data.get("tokens"), list):  # /detokenize's
        limits.check("max_prompt_token_ids", len(data["tokens"]), "tokens")
    try:
        body = kind.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(x) for x in first.get("loc", ())) or "body"
        raise InvalidArgument(f"{param}: {first.get('msg')}") from None
    n = getattr(body, "n", None)
    if n is not None:  # again: pydantic may have read "200" as 200
        limits.check("max_n", n, "n")
    return body


async def read_body(intake, request, kind: type[Body]) -> Body:
    """A route's body as `kind` (parse_body), its chunks parsed on the intake's parse
    threads in its caller's turn, never on the event loop."""
    chunks = [chunk async for chunk in request.stream() if chunk]
    try:
        return await intake.parse(parse_body, chunks, kind, intake.limits,
                                  key=request.scope.get(KEY_ID, ""))
    finally:
        parsed(request.scope)


def parsed(scope) -> None:
    """The body of this request is parsed: its bytes leave the unparsed budget."""
    held = scope.get(HELD)
    if held is not None:
        held.release()


def budgets(limits: Limits) -> tuple[int, int]:
    """(objects and arrays, values) that a body within the limits can hold: each message
    and a few content parts, each prompt, every token id, and room for the rest (a JSON
    schema, stream options)."""
    containers = 4 * limits.max_messages + limits.max_prompts + 4096
    values = limits.max_prompt_token_ids + limits.max_stop_token_ids + 8 * containers
    return containers, values


def load_json(raw: bytes, limits: Limits, max_model_len: int | None = None):
    try:
        if (_count(raw, (b"{", b"["), CHEAP) <= CHEAP
                and _count(raw, (b",",), 32 * CHEAP) <= 32 * CHEAP):
            return json.loads(raw)
        decoder = _CountingDecoder(limits, *budgets(limits), max_model_len)
        return decoder.decode(raw.decode("utf-8"))
    except RecursionError:
        raise InvalidArgument("body: JSON nested too deeply") from None
    except OverLimit:
        raise
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise InvalidArgument(f"body: not valid JSON ({e})") from None


def _count(raw: bytes, chars: tuple[bytes, ...], bound: int) -> int:
    """How often `chars` occur in `raw`, counted a slice at a time, up to past `bound`."""
    n = 0
    for i in range(0, len(raw), SLICE):
        n += sum(raw.count(c, i, i + SLICE) for c in chars)
        if n > bound:
            break
    return n


def _fits(where: str, ids: int, max_model_len: int | None, more: bool = False) -> None:
    """A prompt of `ids` token ids (`more`: or more) can fit the model, or is refused."""
    if max_model_len is not None and ids >= max_model_len:
        what = f"{ids} or more" if more else str(ids)
        raise InvalidArgument(f"{where}: {what} token ids; max_model_len is {max_model_len}")


def _check(limits: Limits, limit: str, got: int, where: str, more: bool = False) -> None:
    """`limits.check`, or the engine's fixed bound on choices."""
    if limit == CHOICES:
        check_bound(where, got, constraint_limits.MAX_CHOICES, "choices", more)
    elif limit == PROMPT_IDS:
        pass  # in all, they count against max_prompt_token_ids once parsed
    else:
        limits.check(limit, got, where, more)


class _Keys(dict):
    """An object's memo for JSONObject, which hands it each key, decoded (escapes and
    all), just before it parses that key's value: the last one is kept."""

    last: str = ""

    def setdefault(self, key, default=None):
        self.last = key
        return key


class _CountingDecoder(json.JSONDecoder):
    """Python's own JSON scanner (strings still parsed in C) that counts as it goes and
    stops at the first count over its bound: the items of each array that has a limit
    (ARRAY_LIMITS, found by its decoded keys), chat messages (objects with a string
    "role"), the values inside a constraint, and all the objects, arrays and values."""

    def __init__(self, limits: Limits, containers: int, values: int,
                 max_model_len: int | None = None):
        super().__init__(object_pairs_hook=self._object)
        self.limits, self.containers_left, self.values_left = limits, containers, values
        self.max_model_len = max_model_len
        self.constraint_values_left = constraint_limits.MAX_CONSTRAINT_CHARS
        self.messages = 0
        self.path: list[str | None] = []  # the keys down to the value being parsed
        self.parse_object, self.parse_array = self._parse_object, self._parse_array
        self.scan_once = py_make_scanner(self)

    def _counted(self, scan_once, segment: Callable[[], str | None], limit: str | None):
        """`scan_once` for a container's values, each counted (and, when the container
        is an array with a `limit`, counted against it); `segment()` names the value
        (its key, or None in an array) in `path` while it is parsed."""
        items = 0
        where = "prompt" if limit == PROMPT_IDS else ".".join(map(str, self.path)) if limit else ""

        def scan(string, idx):
            nonlocal items, limit
            self.values_left -= 1
            if self.values_left < 0:
                raise InvalidArgument("body: more JSON values than a request within the "
                                      "size limits holds")
            if limit is not None:
                if not items and where == "prompt" and string[idx] in "-0123456789":
                    limit = "max_prompt_token_ids"  # one prompt of token ids
                items += 1
                _check(self.limits, limit, items, where, more=True)
                if limit in ("max_prompt_token_ids", PROMPT_IDS):
                    _fits(where, items, self.max_model_len, more=True)
            self.path.append(segment())
            try:
                if self.path[0] in CONSTRAINT_KEYS:
                    self.constraint_values_left -= 1
                    if self.constraint_values_left < 0:
                        raise OverLimit(f"{self.path[0]}: more JSON values than a "
                                        "constraint within the limit of "
                                        f"{constraint_limits.MAX_CONSTRAINT_CHARS} "
                                        "characters holds")
                return scan_once(string, idx)
            finally:
                self.path.pop()

        return scan

    def _enter(self) -> None:
        self.containers_left -= 1
        if self.containers_left < 0:
            raise InvalidArgument("body: more JSON objects and arrays than a request within "
                                  "the size limits holds")

    def _parse_object(self, s_and_end, strict, scan_once, object_hook, pairs_hook, memo):
        self._enter()
        keys = _Keys()
        return JSONObject(s_and_end, strict, self._counted(scan_once, lambda: keys.last, None),
                          object_hook, pairs_hook, keys)

    def _parse_array(self, s_and_end, scan_once):
        self._enter()
        path = tuple(self.path)
        # One of several prompts: counted against the model (its ids, if any).
        limit = PROMPT_IDS if path == ("prompt", None) else ARRAY_LIMITS.get(path)
        return JSONArray(s_and_end, self._counted(scan_once, lambda: None, limit))

    def _object(self, pairs: list) -> dict:
        out = dict(pairs)
        if isinstance(out.get("role"), str):
            self.messages += 1
            self.limits.check("max_messages", self.messages, "messages", more=True)
        return out


def check_counts(data: dict, limits: Limits, max_model_len: int | None = None) -> None:
    """Each count and length of a parsed body against its limit, before any per-item
    work: the types are not checked yet (pydantic does that next), so what is not the
    expected shape is skipped here."""
    check = limits.check
    if isinstance(data.get("n"), int):
        check("max_n", data["n"], "n")
    prompt = data.get("prompt")
    if isinstance(prompt, str):
        check("max_prompt_chars", len(prompt), "prompt")
    elif isinstance(prompt, list) and prompt:
        if isinstance(prompt[0], int):  # one prompt of token ids
            check("max_prompt_token_ids", len(prompt), "prompt")
            _fits("prompt", len(prompt), max_model_len)
        else:
            check("max_prompts", len(prompt), "prompt")
            check("max_prompt_chars", sum(len(p) for p in prompt if isinstance(p, str)),
                  "prompt")
            check("max_prompt_token_ids",
                  sum(len(p) for p in prompt if isinstance(p, list)), "prompt")
            _fits("prompt", max((len(p) for p in prompt if isinstance(p, list)), default=0),
                  max_model_len)
    messages = data.get("messages")
    if isinstance(messages, list):
        check("max_messages", len(messages), "messages")
        check("max_prompt_chars", sum(map(_content_chars, messages)), "messages")
    for row in TABLE:  # every bounded key of a body
        value = data.get(row.body) if row.body else None
        if row.body and isinstance(value, (list, str, dict)):
            check(row.name, count(row, value), row.body)
    outputs = data.get("structured_outputs")
    for where, choices in (("guided_choice", data.get("guided_choice")),
                           ("structured_outputs.choice",
                            outputs.get("choice") if isinstance(outputs, dict) else None)):
        if isinstance(choices, list):
            _check(limits, CHOICES, len(choices), where)


def _content_chars(message) -> int:
    """The characters of every string of a message that a chat template may render: its
    content (or text parts), name, reasoning, tool result id, and its tool calls' ids,
    names and arguments (as router/chat.py counts them on the wire's message)."""
    if not isinstance(message, dict):
        return 0
    content = message.get("content")
    parts = content if isinstance(content, list) else [{"text": content}]
    total = sum(_chars(p.get("text")) for p in parts if isinstance(p, dict))
    total += sum(_chars(message.get(key)) for key in MESSAGE_STRINGS)
    calls = message.get("tool_calls")
    for call in calls if isinstance(calls, list) else ():
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            total += _chars(call.get("id")) + _chars(function.get("name")) + _chars(
                function.get("arguments"))
    return total


def _chars(value) -> int:
    return len(value) if isinstance(value, str) else 0

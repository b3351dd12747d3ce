"""A Generate or Tokenize request counted on its wire bytes, before protobuf parses it.

Parsing builds an object per chat message, stop string, token id and choice: a million
empty messages (2 MB) take protobuf a quarter of a second. The router's interceptor runs
these checks, then the parse, on the intake's parse threads once the call is authorized
(services/rpc/server.py), never on the event loop. They walk every field of each
message that holds a repeated field (the request, its chat and its messages, its token
ids, its sampling, its structured output and its choices), one field at a time, and stop
one past the limit, so a giant request is refused for the price of its first few
thousand fields; every repeated or map field is counted against a bound of its own (a
packed list of ints is one field: its ints are counted on its bytes); long strings are
measured on their bytes, never turned into Python strings.

What the walk cannot skip is refused ("request: ..."), never passed on: a group (wire
types 3 and 4: protobuf keeps an unknown one, and the walk would lose its place in the
fields after it), wire types 6 and 7, field number 0, a varint or a field that runs past
the end of its message. No well-formed request holds any of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from google.protobuf.descriptor import FieldDescriptor

from baton.services.common import constraint_limits
from baton.services.common.limits import (
    ITEMS,
    MAX_TOOL_CALLS,
    MAX_TOOLS,
    TABLE,
    Limits,
    check_bound,
)
from baton.services.common.sampling_params import MAX_START_AFTER
from baton.services.rpc.errors import InvalidArgument
from baton.v1 import generation_pb2 as gen

VARINT, I64, LEN, I32 = 0, 1, 2, 5
# Fields not counted against a limit of their own, in one request: far more than any
# request within the limits holds (each singular field once, a few split messages).
OTHER_FIELDS = 4096
_LOW = bytes(range(128))  # a varint's last byte is one of these
_NOT_CONTINUATION = bytes(range(0x80)) + bytes(range(0xC0, 0x100))  # UTF-8: a character


def _number(message, name: str) -> int:
    return message.DESCRIPTOR.fields_by_name[name].number


CHAT, MESSAGES = _number(gen.GenerateRequest, "chat"), _number(gen.ChatMessages, "messages")
TOOLS, TOOL_CALLS = _number(gen.ChatMessages, "tools"), _number(gen.ChatMessage, "tool_calls")
# A message's own fields (role, content, ...) cost nothing of OTHER_FIELDS, up to this many.
MESSAGE_FIELDS = len(gen.ChatMessage.DESCRIPTOR.fields)
TOKEN_IDS, IDS = _number(gen.GenerateRequest, "token_ids"), _number(gen.TokenIds, "ids")
SAMPLING = _number(gen.GenerateRequest, "sampling")
STRUCTURED = _number(gen.SamplingParams, "structured_output")
CHOICE, CHOICES = _number(gen.StructuredOutput, "choice"), _number(gen.Choices, "choices")
START_AFTER = _number(gen.StructuredOutput, "start_after_token_ids")
CONSTRAINT_STRINGS = {_number(gen.StructuredOutput, name): name
                      for name in ("json_schema", "regex", "grammar")}
TOKENIZE_CHAT = _number(gen.TokenizeRequest, "chat")
STRUCTURED_FIELD = "sampling.structured_output"
_INTS = {FieldDescriptor.CPPTYPE_INT32, FieldDescriptor.CPPTYPE_INT64,
         FieldDescriptor.CPPTYPE_UINT32, FieldDescriptor.CPPTYPE_UINT64}


@dataclass(frozen=True)
class Bounded:
    """A field of one message that rows of the limits' TABLE bound, as the walk reads it:
    where it is (its wire path), whether it is a list of ints (packed or not), and the
    wire type of one of its items."""

    where: str
    ints: bool
    rows: tuple
    kind: int


def _bounded(message, scope: str, every: bool = True) -> dict[int, Bounded]:
    """The fields of `message` (at the wire path `scope`) that the TABLE bounds, by field
    number. `every`: each row at `scope` must name a field of it (else only those that
    do: a TokenizeRequest has a text, not a cache_salt)."""
    out: dict[int, Bounded] = {}
    for row in TABLE:
        at, _, name = (row.wire or "").rpartition(".")
        if row.wire is None or at != scope:
            continue
        if name not in message.DESCRIPTOR.fields_by_name and not every:
            continue
        fd = message.DESCRIPTOR.fields_by_name[name]
        ints = fd.cpp_type in _INTS
        old = out.get(fd.number)
        out[fd.number] = Bounded(row.wire, ints, (old.rows if old else ()) + (row,),
                                 VARINT if ints else LEN)
    return out


GENERATE_BOUNDED = _bounded(gen.GenerateRequest, "")
SAMPLING_BOUNDED = _bounded(gen.SamplingParams, "sampling")
TOKENIZE_BOUNDED = _bounded(gen.TokenizeRequest, "", every=False)


def _counted(bounded: dict[int, Bounded]) -> frozenset:
    """The (number, wire type) of each item of a bounded list: counted against its row,
    never against OTHER_FIELDS."""
    return frozenset((n, b.kind) for n, b in bounded.items()
                     if any(r.count == ITEMS for r in b.rows))


def _refuse(why: str, at: int) -> InvalidArgument:
    return InvalidArgument(f"request: {why} (at byte {at}); not a protobuf message the "
                           "router takes")


def _varint(raw: bytes, i: int, end: int) -> tuple[int, int]:
    """The varint at raw[i:] and where it ends; refused if it runs past `end`."""
    value = shift = 0
    at = i
    while i < end and shift < 70:
        b = raw[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7
    raise _refuse("a varint over 10 bytes, or past the end of its message", at)


def _chars(raw: bytes, start: int, end: int) -> int:
    """The characters of the UTF-8 text in raw[start:end] (its bytes less continuations)."""
    part = raw[start:end]
    return len(part) - len(part.translate(None, _NOT_CONTINUATION))


def _varints(raw: bytes, start: int, end: int) -> int:
    """How many varints end in raw[start:end] (exact for a packed field)."""
    part = raw[start:end]
    return len(part) - len(part.translate(None, _LOW))


def _packed(raw: bytes, kind: int, start: int, end: int, bound: int) -> int:
    """The ints that field raw[start:end] of wire type `kind` holds (packed or one),
    counted no further than one past `bound`: no varint is over 10 bytes, so a packed
    field of 60M ids costs what one of `bound` does."""
    return _varints(raw, start, min(end, start + 10 * (bound + 1))) if kind == LEN else 1


class _Walk:
    def __init__(self, raw: bytes, limits: Limits, max_model_len: int | None = None):
        self.raw, self.limits, self.max_model_len = raw, limits, max_model_len
        self.other_left = OTHER_FIELDS
        self.counts: dict[str, int] = {}

    def fields(self, start: int, end: int, counted: frozenset = frozenset()
               ) -> Iterator[tuple[int, int, int, int]]:
        """(number, wire type, value start, value end) of each field in raw[start:end].
        Each costs one of OTHER_FIELDS, but for the (number, wire type) pairs in `counted`:
        each of those is one item that the caller counts against a limit of its own."""
        raw, i = self.raw, start
        while i < end:
            at = i
            key, i = _varint(raw, i, end)
            number, kind = key >> 3, key & 7
            if kind == VARINT:
                j = _varint(raw, i, end)[1]
            elif kind == LEN:
                length, i = _varint(raw, i, end)
                j = i + length
            elif kind in (I64, I32):
                j = i + (8 if kind == I64 else 4)
            else:
                raise _refuse(f"wire type {kind} (a group, or not protobuf)", at)
            if number == 0:
                raise _refuse("field number 0", at)
            if j > end:
                raise _refuse(f"field {number} runs past the end of its message", at)
            if (number, kind) not in counted:
                self.other_left -= 1
                if self.other_left < 0:
                    raise InvalidArgument("request: more protobuf fields than a request "
                                          "within the size limits holds")
            yield number, kind, i, j
            i = j

    def tally(self, what: str, count: int) -> int:
        """`what`'s count so far in the request (protobuf merges repeated messages)."""
        self.counts[what] = self.counts.get(what, 0) + count
        return self.counts[what]

    def add(self, where: str, limit: str, count: int) -> None:
        self.limits.check(limit, self.tally(where, count), where, more=True)

    def bounded(self, field: Bounded, kind: int, start: int, end: int) -> None:
        """A field the TABLE bounds: each of its rows' counts, its items (those of a packed
        list counted on its bytes) or its characters."""
        if kind != field.kind and not (field.ints and kind == LEN):
            return  # not what the field holds: protobuf refuses it
        for row in field.rows:
            most = self.limits.bound(row.name)
            if row.count == ITEMS:
                n = _packed(self.raw, kind, start, end, most) if field.ints else 1
                self.add(field.where, row.name, n)
            elif end - start > most:  # no more characters than bytes
                self.limits.check(row.name, _chars(self.raw, start, end), field.where)

    def chat(self, start: int, end: int) -> None:
        counted = frozenset({(MESSAGES, LEN), (TOOLS, LEN)})
        for number, kind, a, b in self.fields(start, end, counted):
            if number == MESSAGES and kind == LEN:
                self.add("chat.messages", "max_messages", 1)
                self.message(a, b)
            elif number == TOOLS and kind == LEN:
                check_bound("chat.tools", self.tally("chat.tools", 1), MAX_TOOLS, "tools",
                            more=True)

    def message(self, start: int, end: int) -> None:
        """A chat message's tool calls (the other fields are strings, bounded later)."""
        self.other_left += MESSAGE_FIELDS
        for number, kind, _, _ in self.fields(start, end, frozenset({(TOOL_CALLS, LEN)})):
            if number == TOOL_CALLS and kind == LEN:
                check_bound("chat.messages", self.tally("tool calls", 1), MAX_TOOL_CALLS,
                            "tool calls", more=True)

    def token_ids(self, start: int, end: int) -> None:
        for number, kind, a, b in self.fields(start, end, frozenset({(IDS, VARINT)})):
            if number == IDS:
                self.prompt_ids("token_ids", kind, a, b)

    def prompt_ids(self, where: str, kind: int, start: int, end: int) -> None:
        """One field of prompt ids, packed (counted as bytes, never one id at a time) or
        not, against max_prompt_token_ids and the model's length."""
        self.add(where, "max_prompt_token_ids",
                 _varints(self.raw, start, end) if kind == LEN else 1)
        most = self.max_model_len
        if most is not None and self.counts[where] >= most:
            raise InvalidArgument(f"{where}: {self.counts[where]} or more token ids; "
                                  f"max_model_len is {most}")

    def sampling(self, start: int, end: int) -> None:
        for number, kind, a, b in self.fields(start, end, _counted(SAMPLING_BOUNDED)):
            if number in SAMPLING_BOUNDED:
                self.bounded(SAMPLING_BOUNDED[number], kind, a, b)
            elif number == STRUCTURED and kind == LEN:
                self.structured(a, b)

    def structured(self, start: int, end: int) -> None:
        """The engine's fixed bounds on a constraint (constraint_limits.py) and on its
        start marker."""
        for number, kind, a, b in self.fields(start, end, frozenset({(START_AFTER, VARINT)})):
            if number == START_AFTER:  # packed (one field of any length) or not
                where = f"{STRUCTURED_FIELD}.start_after_token_ids"
                count = self.tally(where, _packed(self.raw, kind, a, b, MAX_START_AFTER))
                check_bound(where, count, MAX_START_AFTER, "token ids", more=True)
            elif kind != LEN:
                continue
            elif number in CONSTRAINT_STRINGS:
                self.constraint_text(f"{STRUCTURED_FIELD}.{CONSTRAINT_STRINGS[number]}", a, b)
            elif number == CHOICE:
                self.choices(a, b)

    def constraint_text(self, where: str, start: int, end: int) -> None:
        """A constraint's text (schema, regex, grammar) against the engine's fixed bound."""
        most = constraint_limits.MAX_CONSTRAINT_CHARS
        if end - start > most:  # no more characters than bytes: counted only past it
            check_bound(where, _chars(self.raw, start, end), most, "characters", more=True)

    def choices(self, start: int, end: int, where: str = f"{STRUCTURED_FIELD}.choice") -> None:
        """A Choices message (or vLLM's ChoiceConstraint: the same field 1) at `where`."""
        for number, kind, a, b in self.fields(start, end, frozenset({(CHOICES, LEN)})):
            if number == CHOICES and kind == LEN:
                check_bound(where, self.tally(where, 1), constraint_limits.MAX_CHOICES,
                            "choices", more=True)
                check_bound(where, self.tally(where + " chars", _chars(self.raw, a, b)),
                            constraint_limits.MAX_CONSTRAINT_CHARS, "characters", more=True)


def check_generate(limits: Limits, max_model_len: Callable[[], int | None] = lambda: None
                   ) -> Callable[[bytes], None]:
    """The raw check of Generate: chat messages, token ids (and against the model's
    length, once `max_model_len()` knows it), stop strings and their lengths, stop ids,
    logit_bias entries, bad_words and their lengths, the lengths of text, cache_salt and
    request_id, and the structured-output constraint's choices, size and start marker."""
    def check(raw: bytes) -> None:
        walk = _Walk(raw, limits, max_model_len())
        for number, kind, a, b in walk.fields(0, len(raw), _counted(GENERATE_BOUNDED)):
            if number in GENERATE_BOUNDED:
                walk.bounded(GENERATE_BOUNDED[number], kind, a, b)
            elif kind != LEN:
                continue
            elif number == CHAT:
                walk.chat(a, b)
            elif number == TOKEN_IDS:
                walk.token_ids(a, b)
            elif number == SAMPLING:
                walk.sampling(a, b)

    return check


def check_tokenize(limits: Limits) -> Callable[[bytes], None]:
    """The raw check of Tokenize: chat messages, the length of text."""
    def check(raw: bytes) -> None:
        walk = _Walk(raw, limits)
        for number, kind, a, b in walk.fields(0, len(raw), _counted(TOKENIZE_BOUNDED)):
            if number in TOKENIZE_BOUNDED:
                walk.bounded(TOKENIZE_BOUNDED[number], kind, a, b)
            elif number == TOKENIZE_CHAT and kind == LEN:
                walk.chat(a, b)

    return check

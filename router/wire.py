"""A Generate or Tokenize request counted on its wire bytes, before protobuf parses it.

Parsing builds an object per chat message and stop string, on the event loop that
serves every other call: a million empty messages (7.6 MB) take protobuf a quarter of a
second. These counts walk only the fields that repeat, one field at a time, and stop one
past the limit, so a giant request is refused for the price of its first few thousand
fields; long strings are measured on their bytes, never turned into Python strings.
(Malformed bytes end the walk quietly: protobuf then refuses them itself.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from baton.v1 import generation_pb2 as gen
from services.serving.errors import InvalidArgument
from services.serving.limits import Limits

VARINT, I64, LEN, I32 = 0, 1, 2, 5
_LOW = bytes(range(128))  # a varint's last byte is one of these
_NOT_CONTINUATION = bytes(range(0x80)) + bytes(range(0xC0, 0x100))  # UTF-8: a character


def _number(message, name: str) -> int:
    return message.DESCRIPTOR.fields_by_name[name].number


CHAT, MESSAGES = _number(gen.GenerateRequest, "chat"), _number(gen.ChatMessages, "messages")
TOKEN_IDS = _number(gen.GenerateRequest, "token_ids")
SAMPLING = _number(gen.GenerateRequest, "sampling")
STOP = _number(gen.SamplingParams, "stop")
STOP_TOKEN_IDS = _number(gen.SamplingParams, "stop_token_ids")
TOKENIZE_CHAT = _number(gen.TokenizeRequest, "chat")
# The strings whose length is bounded: field number -> (limit, field).
GENERATE_STRINGS = {_number(gen.GenerateRequest, name): (limit, name) for name, limit in (
    ("text", "max_prompt_chars"), ("cache_salt", "max_cache_salt_chars"),
    ("request_id", "max_request_id_chars"))}
TOKENIZE_STRINGS = {_number(gen.TokenizeRequest, "text"): ("max_prompt_chars", "text")}


def _varint(raw: bytes, i: int) -> tuple[int | None, int]:
    value = shift = 0
    while i < len(raw) and shift < 64:
        b = raw[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7
    return None, i


def _chars(raw: bytes, start: int, end: int) -> int:
    """The characters of the UTF-8 text in raw[start:end] (its bytes less continuations)."""
    part = raw[start:end]
    return len(part) - len(part.translate(None, _NOT_CONTINUATION))


def _varints(raw: bytes, start: int, end: int) -> int:
    """How many varints end in raw[start:end] (exact for a packed field)."""
    part = raw[start:end]
    return len(part) - len(part.translate(None, _LOW))


class _Walk:
    def __init__(self, raw: bytes, limits: Limits):
        self.raw, self.limits = raw, limits
        self.fields_left = limits.max_messages + limits.max_stop + limits.max_stop_token_ids \
            + 1024  # more than any request within the limits holds
        self.counts: dict[str, int] = {}

    def fields(self, start: int, end: int) -> Iterator[tuple[int, int, int, int]]:
        """(number, wire type, value start, value end) of each field in raw[start:end]."""
        raw, i = self.raw, start
        while i < end:
            self.fields_left -= 1
            if self.fields_left < 0:
                raise InvalidArgument("request: more protobuf fields than a request within "
                                      "the size limits holds")
            key, i = _varint(raw, i)
            if key is None:
                return
            kind, j = key & 7, None
            if kind == VARINT:
                j = _varint(raw, i)[1]
            elif kind == LEN:
                length, i = _varint(raw, i)
                j = None if length is None else i + length
            elif kind in (I64, I32):
                j = i + (8 if kind == I64 else 4)
            if j is None or j > end:
                return
            yield key >> 3, kind, i, j
            i = j

    def add(self, where: str, limit: str, count: int) -> None:
        self.counts[where] = self.counts.get(where, 0) + count
        self.limits.check(limit, self.counts[where], where, more=True)

    def string(self, start: int, end: int, limit: str, where: str) -> None:
        if end - start > getattr(self.limits, limit):  # no more characters than bytes
            self.limits.check(limit, _chars(self.raw, start, end), where)

    def chat(self, start: int, end: int) -> None:
        for number, _, _, _ in self.fields(start, end):
            if number == MESSAGES:
                self.add("chat.messages", "max_messages", 1)

    def sampling(self, start: int, end: int) -> None:
        for number, kind, a, b in self.fields(start, end):
            if number == STOP:
                self.add("sampling.stop", "max_stop", 1)
            elif number == STOP_TOKEN_IDS:
                self.add("sampling.stop_token_ids", "max_stop_token_ids",
                         _varints(self.raw, a, b) if kind == LEN else 1)


def check_generate(limits: Limits) -> Callable[[bytes], None]:
    """The raw check of Generate: chat messages, token ids, stop strings, stop ids, the
    lengths of text, cache_salt and request_id."""
    def check(raw: bytes) -> None:
        walk = _Walk(raw, limits)
        for number, kind, a, b in walk.fields(0, len(raw)):
            if kind != LEN:
                continue
            if number in GENERATE_STRINGS:
                walk.string(a, b, *GENERATE_STRINGS[number])
            elif number == CHAT:
                walk.chat(a, b)
            elif number == TOKEN_IDS:  # counted as bytes: never walked one id at a time
                walk.add("token_ids", "max_prompt_token_ids", _varints(raw, a, b))
            elif number == SAMPLING:
                walk.sampling(a, b)

    return check


def check_tokenize(limits: Limits) -> Callable[[bytes], None]:
    """The raw check of Tokenize: chat messages, the length of text."""
    def check(raw: bytes) -> None:
        walk = _Walk(raw, limits)
        for number, kind, a, b in walk.fields(0, len(raw)):
            if kind == LEN and number in TOKENIZE_STRINGS:
                walk.string(a, b, *TOKENIZE_STRINGS[number])
            elif number == TOKENIZE_CHAT and kind == LEN:
                walk.chat(a, b)

    return check

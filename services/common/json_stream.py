"""One JSON value re-serialized in compact form as its text arrives, torch-free.

A model writes a tool call's arguments a few characters at a time, spaced as it likes
(`{"city": "Paris"}`); clients get them compact (`{"city":"Paris"}`), the text
`json.dumps(value, ensure_ascii=False, separators=(",", ":"))` gives. `JsonStream` emits
that compact text while the value is still arriving: each structural character, key and
string character as soon as it is read, a number or literal once the character after it
shows it has ended. What it has emitted never changes, so streamed fragments join to the
whole. It is lenient where models are (raw control characters inside strings, as
`json.loads(strict=False)` allows) and strict where the result must stay valid JSON (no NaN
or Infinity, no lone surrogate, no duplicate key).
"""

from __future__ import annotations

import json
import math
import re

WS = " \t\r\n"
_PLAIN = re.compile(r'[^"\\\x00-\x1f]+')  # string characters json.dumps leaves as they are
NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_LITERALS = ("true", "false", "null")
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r",
            "t": "\t"}
_HEX = frozenset("0123456789abcdefABCDEF")
MAX_DEPTH = 128
MAX_SCALAR = 4000  # characters in one number or literal


class JsonError(ValueError):
    """The text is not (the start of) one JSON value; `pos` indexes the offending character
    in the text that was being fed."""

    def __init__(self, pos: int, why: str):
        super().__init__(f"{why} at {pos}")
        self.pos = pos


def escape(text: str) -> str:
    """`text` as json.dumps writes it inside quotes (ensure_ascii=False); per character, so
    the escapes of pieces join to the escape of the whole."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def dump(value) -> str:
    """The compact JSON text clients get."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


class JsonStream:
    """Feed the text of one JSON value in pieces; `out` grows with its compact form, `done`
    turns true when the value has ended."""

    def __init__(self) -> None:
        self.out = ""
        self.done = False
        self._stack: list[str] = []       # open containers, "{" or "["
        self._keys: list[set[str]] = []   # keys seen, per open object
        self._expect = "value"  # value, value_or_close, key, key_or_close, colon, comma_or_close
        self._token = ""        # token being read: "str", "num", "lit" or ""
        self._buf = ""          # number or literal characters, or a pending escape
        self._is_key = False
        self._key: list[str] = []
        self._high: int | None = None     # a high surrogate waiting for its low half

    def feed(self, text: str, pos: int = 0) -> int | None:
        """Read text[pos:]. Returns the index just past the value's end once it has ended
        (what follows is not read), else None. Raises JsonError on text that cannot be
        JSON."""
        if self.done:
            raise JsonError(pos, "text after the value")
        out: list[str] = []
        try:
            return self._feed(text, pos, out)
        finally:
            self.out += "".join(out)

    def _feed(self, text: str, i: int, out: list[str]) -> int | None:
        n = len(text)
        while i < n:
            if self._token == "str":
                i = self._string(text, i, out)
            elif self._token:
                c = text[i]
                if c in _NUMBER_CHARS if self._token == "num" else "a" <= c <= "z":
                    self._buf += c
                    if len(self._buf) > MAX_SCALAR or (
                            self._token == "lit"
                            and not any(w.startswith(self._buf) for w in _LITERALS)):
                        raise JsonError(i, "not a JSON value")
                    i += 1
                    continue
                self._scalar_done(i, out)  # c is not part of it: read it again below
            else:
                i = self._structure(text, i, out)
            if self.done:
                return i
        return None

    def _structure(self, text: str, i: int, out: list[str]) -> int:
        c = text[i]
        if c in WS:
            return i + 1
        expect = self._expect
        if expect in ("value", "value_or_close"):
            if c == "]" and expect == "value_or_close":
                self._close(c, out)
            elif c in "{[":
                if len(self._stack) >= MAX_DEPTH:
                    raise JsonError(i, "nested too deep")
                self._stack.append(c)
                out.append(c)
                if c == "{":
                    self._keys.append(set())
                    self._expect = "key_or_close"
                else:
                    self._expect = "value_or_close"
            elif c == '"':
                self._token, self._is_key = "str", False
                out.append(c)
            elif c == "-" or "0" <= c <= "9":
                self._token, self._buf = "num", c
            elif c in "tfn":
                self._token, self._buf = "lit", c
            else:
                raise JsonError(i, "expected a value")
        elif expect in ("key", "key_or_close"):
            if c == "}" and expect == "key_or_close":
                self._close(c, out)
            elif c == '"':
                self._token, self._is_key, self._key = "str", True, []
                out.append(c)
            else:
                raise JsonError(i, "expected a key")
        elif expect == "colon":
            if c != ":":
                raise JsonError(i, "expected ':'")
            out.append(c)
            self._expect = "value"
        else:  # comma_or_close
            top = self._stack[-1]
            if c == ",":
                out.append(c)
                self._expect = "key" if top == "{" else "value"
            elif c == ("}" if top == "{" else "]"):
                self._close(c, out)
            else:
                raise JsonError(i, "expected ',' or a closing bracket")
        return i + 1

    def _close(self, c: str, out: list[str]) -> None:
        if self._stack.pop() == "{":
            self._keys.pop()
        out.append(c)
        self._value_done()

    def _value_done(self) -> None:
        if self._stack:
            self._expect = "comma_or_close"
        else:
            self.done = True

    def _scalar_done(self, i: int, out: list[str]) -> None:
        word, kind = self._buf, self._token
        self._token, self._buf = "", ""
        if kind == "lit":
            if word not in _LITERALS:
                raise JsonError(i, "not a JSON value")
            out.append(word)
        else:
            if not NUMBER.fullmatch(word):
                raise JsonError(i, "not a JSON number")
            try:
                value = json.loads(word)
            except ValueError:  # more digits than Python converts
                raise JsonError(i, "number too long") from None
            if isinstance(value, float) and not math.isfinite(value):
                raise JsonError(i, "number out of range")
            out.append(json.dumps(value))
        self._value_done()

    def _string(self, text: str, i: int, out: list[str]) -> int:
        n = len(text)
        while i < n:
            if self._buf:  # inside an escape
                c = text[i]
                self._buf += c
                if len(self._buf) == 2 and c != "u":
                    if c not in _ESCAPES or self._high is not None:
                        raise JsonError(i, "bad escape")
                    self._buf = ""
                    self._char(_ESCAPES[c], out)
                elif len(self._buf) > 2:
                    if c not in _HEX:
                        raise JsonError(i, "bad \\u escape")
                    if len(self._buf) == 6:
                        self._unicode(int(self._buf[2:], 16), i, out)
                        self._buf = ""
                i += 1
                continue
            c = text[i]
            if self._high is not None and c != "\\":
                raise JsonError(i, "lone surrogate")
            m = _PLAIN.match(text, i)
            if m:
                self._char(m.group(), out, escaped=False)
                i = m.end()
            elif c == '"':
                out.append(c)
                self._token = ""
                if self._is_key:
                    key = "".join(self._key)
                    if key in self._keys[-1]:
                        raise JsonError(i, "duplicate key")
                    self._keys[-1].add(key)
                    self._expect = "colon"
                else:
                    self._value_done()
                return i + 1
            elif c == "\\":
                self._buf = c
                i += 1
            else:  # a raw control character: kept, written escaped
                self._char(c, out)
                i += 1
        return i

    def _unicode(self, code: int, i: int, out: list[str]) -> None:
        if self._high is not None:
            if not 0xDC00 <= code <= 0xDFFF:
                raise JsonError(i, "lone surrogate")
            code = 0x10000 + ((self._high - 0xD800) << 10) + (code - 0xDC00)
            self._high = None
        elif 0xD800 <= code <= 0xDBFF:
            self._high = code
            return
        elif 0xDC00 <= code <= 0xDFFF:
            raise JsonError(i, "lone surrogate")
        self._char(chr(code), out)

    def _char(self, s: str, out: list[str], escaped: bool = True) -> None:
        out.append(escape(s) if escaped else s)
        if self._is_key:
            self._key.append(s)


def compact(text: str) -> str:
    """The compact form of a whole JSON text (whitespace around it allowed); JsonError if
    it is not exactly one JSON value."""
    stream = JsonStream()
    end = stream.feed(text)
    if end is None:
        # A bare number needs the character after it to end: give it a space.
        end = stream.feed(" ", 0) if stream._token == "num" else None
        if end is None:
            raise JsonError(len(text), "unfinished value")
        end = len(text)
    if text[end:].strip(WS):
        raise JsonError(end, "text after the value")
    return stream.out

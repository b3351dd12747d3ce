"""The tool-call formats models write, torch-free (tool_parser_base.py has the rules
shared by all of them).

hermes       Hermes 2 Pro, Qwen2.5, Qwen3: `<tool_call>\\n{"name": "f", "arguments": {...}}\\n
             </tool_call>`, one block per call (Hermes 2 Pro writes "arguments" first).
llama3_json  Llama 3.1/3.2's JSON calls: `{"name": "f", "parameters": {...}}` as the whole
             output, or after `<|python_tag|>`; several joined by `;`.
mistral      `[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]` (tokenizers up to v7), and
             `[TOOL_CALLS]f[ARGS]{...}` per call (v11 on; `[CALL_ID]id` before `[ARGS]` is
             skipped).
(Qwen3-Coder's XML form is in tool_parser_qwen3_coder.py.)

The tags must reach the parser: `[TOOL_CALLS]`, `[ARGS]` and `<|python_tag|>` are special
tokens, so the text must be detokenized with special tokens kept.
"""

from __future__ import annotations

import json
import re

from .json_stream import WS, JsonError, JsonStream, compact
from .tool_parser_base import MAX_NAME, Bad, Body, Call, ToolParser


class Envelope(Call):
    """A call as a JSON object, `{"name": ..., "arguments": {...}}`, read as it arrives.
    `args_keys` name the arguments (Llama writes "parameters"), `extra_keys` may appear and
    are ignored; any other key breaks it. The arguments stream as they come when they are
    an object; sent as a JSON string holding an object, they come whole at the end; a call
    without them gets {}. The name may come after the arguments (Hermes 2 Pro writes it
    last): then nothing is sent before it."""

    def __init__(self, body: Body, args_keys: tuple[str, ...], extra_keys: tuple[str, ...]):
        super().__init__()
        self._body, self._args_keys, self._extra = body, args_keys, extra_keys
        self._expect = "open"
        self._seen: set[str] = set()
        self._key = ""
        self._value: JsonStream | None = None
        self._args: JsonStream | None = None

    def feed(self, text: str, i: int) -> int | None:
        n = len(text)
        while i < n:
            if self._value is not None:
                end = self._value.feed(text, i)
                self._sync()
                if end is None:
                    return None
                i = end
                self._value_done(i)
                continue
            c = text[i]
            if c in WS:
                i += 1
                continue
            expect = self._expect
            if expect == "open" and c == "{":
                self._expect = "key_or_close"
            elif expect in ("key", "key_or_close") and c == '"':
                self._key, self._value = "?", JsonStream()
                continue  # the stream reads the key, quote and all
            elif expect == "key_or_close" and c == "}" or expect == "comma" and c == "}":
                return self._close(i)
            elif expect == "comma" and c == ",":
                self._expect = "key"
            elif expect == "colon" and c == ":":
                self._expect = "value"
            elif expect == "value":
                if (self._key == "name" and c != '"'
                        or self._key in self._args_keys and c not in '{"'):
                    raise JsonError(i, "not a call")
                self._value = JsonStream()
                if self._key in self._args_keys and c == "{":
                    self._args = self._value
                continue
            else:
                raise JsonError(i, "not a call")
            i += 1
        return None

    def _value_done(self, i: int) -> None:
        value, self._value = self._value, None
        assert value is not None  # the value that has just ended
        if self._key == "?":  # a key has been read
            key = json.loads(value.out)
            allowed = ("name", *self._args_keys, *self._extra)
            if key not in allowed or key in self._seen or (
                    key in self._args_keys and self._seen & set(self._args_keys)):
                raise JsonError(i, "not a call")
            self._seen.add(key)
            self._key, self._expect = key, "colon"
            return
        self._expect = "comma"
        if self._key == "name":
            try:
                self.name = self._body.check_name(json.loads(value.out))
            except Bad:
                raise JsonError(i, "not a tool's name") from None
        elif self._key in self._args_keys and self._args is None:  # an object in a string
            try:
                self.args = compact(json.loads(value.out))
            except (JsonError, TypeError):
                raise JsonError(i, "arguments not an object") from None
            if not self.args.startswith("{"):
                raise JsonError(i, "arguments not an object")
        self._sync()

    def _close(self, i: int) -> int:
        if self.name is None:
            raise JsonError(i, "a call without a name")
        if not self._seen & set(self._args_keys):
            self.args = "{}"
        self._sync()
        return i + 1

    def _sync(self) -> None:
        if self._args is not None:
            self.args = self._args.out
        self.ready = self.name is not None and (self._args is not None or bool(self.args))


class _HermesBody(Body):
    END = "</tool_call>"

    def __init__(self, names: dict[str, dict]):
        super().__init__(names)
        self.call = Envelope(self, ("arguments",), ())
        self.calls.append(self.call)
        self.closing = False

    def _step(self) -> int | None:
        if not self.closing:
            if not self.json(self.call):
                return None
            self.closing = True
        rest = self.buf.lstrip(WS)
        self.take(len(self.buf) - len(rest))
        if rest.startswith(self.END) or (self.final and self.END.startswith(rest)):
            # At the end of the output the close tag may be missing or cut short.
            self.take(min(len(rest), len(self.END)))
            self.call.complete = True
            return self.at
        if self.END.startswith(rest):
            return None
        raise Bad(self.at)


class HermesToolParser(ToolParser):
    start_tags = ("<tool_call>",)
    end_tag = "</tool_call>"

    def _new_body(self, tag: str) -> Body:
        return _HermesBody(self.names)


class _LlamaBody(Body):
    def __init__(self, names: dict[str, dict]):
        super().__init__(names)
        self.call = self._envelope()
        self.reading = True

    def _envelope(self) -> Envelope:
        env = Envelope(self, ("parameters", "arguments"), ("type",))
        self.calls.append(env)
        return env

    def _step(self) -> int | None:
        while True:
            if self.reading:
                if not self.json(self.call):
                    return None
                self.call.complete, self.checkpoint, self.reading = True, self.at, False
            # After a call: `;` and another call, or the region ends after this one.
            rest = self.buf.lstrip(WS)
            if rest[:1] != ";":
                return None if not rest and not self.final else self.checkpoint
            after = rest[1:].lstrip(WS)
            if not after:
                return self.checkpoint if self.final else None
            if after[0] != "{":
                return self.checkpoint
            self.take(len(self.buf) - len(after))
            self.call, self.reading = self._envelope(), True


class Llama3JsonToolParser(ToolParser):
    start_tags = ("<|python_tag|>",)
    bare_start = True

    def _new_body(self, tag: str) -> Body:
        return _LlamaBody(self.names)


_NAME_CHARS = re.compile(r"[A-Za-z0-9_.\-]*")
_ID_CHARS = re.compile(r"[A-Za-z0-9]*")


class _MistralBody(Body):
    def __init__(self, names: dict[str, dict]):
        super().__init__(names)
        self.state = "start"
        self.call: Call | None = None
        self.args: JsonStream | None = None
        self.had_id = False

    @property
    def _call(self) -> Call:
        assert self.call is not None, "every state but start reads an open call"
        return self.call

    def _envelope(self) -> Envelope:
        self.call = Envelope(self, ("arguments",), ("id",))
        self.calls.append(self.call)
        return self.call

    def _step(self) -> int | None:
        while True:
            state = self.state
            if state in ("start", "list", "list_sep") and not self.skip_ws():
                return None
            if state == "start":  # a JSON list, one JSON call, or name[ARGS]{...}
                c = self.buf[0]
                if c == "[":
                    self.take(1)
                    self.state = "list"
                else:
                    self.state = "one" if c == "{" else "name"
                    if c == "{":
                        self._envelope()
            elif state == "list":
                if self.buf[0] != "{":
                    raise Bad(self.at)
                self._envelope()
                self.state = "list_call"
            elif state in ("list_call", "one"):
                if not self.json(self.call):
                    return None
                self._call.complete, self.checkpoint = True, self.at
                if state == "one":
                    return self.at
                self.state = "list_sep"
            elif state == "list_sep":
                c = self.buf[0]
                if c not in ",]":
                    raise Bad(self.at)
                self.take(1)
                if c == "]":
                    return self.at
                self.state = "list"
            elif state in ("name", "call_id"):
                pattern = _NAME_CHARS if state == "name" else _ID_CHARS
                m = pattern.match(self.buf)  # `*`: it always matches, perhaps empty
                n = m.end() if m else 0
                if n > MAX_NAME or (n == len(self.buf) and self.final):
                    raise Bad(self.at + n)
                if n == len(self.buf):
                    return None
                if state == "name":
                    self.call = Call(self.check_name(self.buf[:n]))
                self.take(n)
                self.state = "tag"
            elif state == "tag":
                tags = ("[ARGS]",) if self.had_id else ("[ARGS]", "[CALL_ID]")
                tag = next((t for t in tags if self.buf.startswith(t)), None)
                if tag is None:
                    if any(t.startswith(self.buf) for t in tags) and not self.final:
                        return None
                    raise Bad(self.at)
                self.take(len(tag))
                if tag == "[CALL_ID]":  # Mistral's own id for the call: ours replaces it
                    self.had_id, self.state = True, "call_id"
                else:
                    self._call.ready = True
                    self.calls.append(self._call)
                    self.state = "args"
            else:  # args: one JSON object
                if self.args is None:
                    if not self.skip_ws():
                        return None
                    if self.buf[0] != "{":
                        raise Bad(self.at)
                    self.args = JsonStream()
                done = self.json(self.args)
                self._call.args = self.args.out
                if not done:
                    return None
                self._call.complete, self.checkpoint = True, self.at
                return self.at


class MistralToolParser(ToolParser):
    start_tags = ("[TOOL_CALLS]",)

    def _new_body(self, tag: str) -> Body:
        return _MistralBody(self.names)


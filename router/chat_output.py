"""One chat choice's output, parsed as it streams: its text split into reasoning, content
and tool calls, once, on the router, for every API (the gRPC stream's `chat` deltas, and
the OpenAI renderer's messages and chunks, which join them).

    text delta ──> reasoning parser ──> content ──> tool calls stage ──> ChatDelta
                   (--reasoning-parser)             auto: --tool-call-parser
                                                    a named function: NamedCall
                                                    "required": RequiredCalls

The streamed pieces are the whole answer: a whole response is these deltas joined, so
the arguments a stream's fragments join to are the arguments of the whole response.
"""

from __future__ import annotations

import json

from baton.services.common.json_stream import WS
from baton.services.common.tool_parsers import ToolCallDelta, tool_call_id
from baton.v1 import generation_pb2 as gen


class ChatOutput:
    """A choice's parsers (a reasoning parser, a tool calls stage; either may be None)."""

    def __init__(self, reasoning, calls):
        self.reasoning = reasoning
        self.calls = calls
        self.called = False  # a tool call has begun

    def step(self, text: str, last: bool) -> gen.ChatDelta:
        """The parts of the next piece of text (`last`: the output ends with it)."""
        thought, content = ("", text) if self.reasoning is None else self.reasoning.feed(text)
        if last and self.reasoning is not None:
            more_thought, more = self.reasoning.finish()
            thought, content = thought + more_thought, content + more
        deltas: list[ToolCallDelta] = []
        if self.calls is not None:
            content, deltas = self.calls.feed(content)
            if last:
                more, more_deltas = self.calls.finish()
                content, deltas = content + more, deltas + more_deltas
        self.called = self.called or bool(deltas)
        return gen.ChatDelta(reasoning_content=thought, content=content, tool_calls=[
            gen.ToolCallDelta(index=d.index, id=d.id or "", name=d.name or "",
                              arguments=d.arguments) for d in merged(deltas)])

    def apply(self, reply: gen.GenerateResponse) -> None:
        """Set the reply's `chat`; an output that called tools and would end STOP ends
        TOOL_CALLS."""
        d = reply.delta
        last = d.finish_reason != gen.FINISH_REASON_UNSPECIFIED
        reply.chat.CopyFrom(self.step(d.text, last))
        if last and self.called and d.finish_reason == gen.FINISH_REASON_STOP:
            d.finish_reason = gen.FINISH_REASON_TOOL_CALLS


def merged(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """Consecutive fragments of one call as one (the first keeps its id and name)."""
    out: list[ToolCallDelta] = []
    for d in deltas:
        if out and out[-1].index == d.index and d.id is None and d.name is None:
            last = out[-1]
            out[-1] = ToolCallDelta(last.index, last.id, last.name, last.arguments + d.arguments)
        else:
            out.append(d)
    return out


class NamedCall:
    """tool_choice names a function: the constrained output is its arguments, one call."""

    def __init__(self, name: str):
        self.name = name
        self.id: str | None = None

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        if not text:
            return "", []
        if self.id is None:
            self.id = tool_call_id()
            return "", [ToolCallDelta(0, self.id, self.name, text)]
        return "", [ToolCallDelta(0, None, None, text)]

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        return "", []


class RequiredCalls:
    """tool_choice "required": the constrained output is a JSON array of
    {"name": ..., "parameters": ...} (compact, as the grammar writes it). Each item is a
    call: its first fragment once its name is known, then its parameters' JSON text as
    it comes, fragment by fragment."""

    def __init__(self):
        self.depth = 0
        self.in_string = self.escape = False
        self.state = ""  # in an item: "key", "colon", "value"
        self.key_text: list[str] = []
        self.key = ""
        self.value: list[str] = []  # the current value's text (a name), or unsent arguments
        self.held: list[str] | None = None  # arguments that came before the name
        self.space: list[str] = []  # whitespace after a value's start, held: it may end it
        self.index = -1
        self.name: str | None = None
        self.sent = False  # the item's first fragment is out

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        out: list[ToolCallDelta] = []
        for c in text:
            self._char(c, out)
        return "", out  # merged once, by ChatOutput

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        return "", []  # an item cut short before its name is no call

    def _char(self, c: str, out: list[ToolCallDelta]) -> None:
        if self.state == "value" and (self.in_string or self.depth > 2 or c not in ",}"):
            if not self.in_string and self.depth == 2 and c in WS:
                if self.value or self.sent:  # a value's leading whitespace is dropped
                    self.space.append(c)
                return
            for held in self.space:
                self._value_char(held, out)
            self.space = []
            self._value_char(c, out)
            self._track(c)
            return
        if self.state == "value":  # "," or "}" in the item: its value ends
            self.space = []  # and so does its trailing whitespace
            self._end_value(out)
            self.state = "key"
        if self.in_string:  # a key
            self.key_text.append(c)
            self._track(c)
            if not self.in_string:
                self.key = _loads("".join(self.key_text), "")
                self.key_text, self.state = [], "colon"
            return
        if c == "{" and self.depth == 1:
            self.index += 1
            self.name, self.sent, self.value, self.held = None, False, [], None
            self.state = "key"
        elif c == "}" and self.depth == 2:
            if self.name is not None and not self.sent:
                self.value = self.held or []
                self._send(out)
            self.state = ""
        elif c == ":" and self.state == "colon":
            self.state, self.value = "value", []
            return
        elif c == '"' and self.state == "key":
            self.key_text = [c]
        self._track(c)

    def _track(self, c: str) -> None:
        if self.in_string:
            if self.escape:
                self.escape = False
            elif c == "\\":
                self.escape = True
            elif c == '"':
                self.in_string = False
        elif c == '"':
            self.in_string = True
        elif c in "{[":
            self.depth += 1
        elif c in "}]":
            self.depth -= 1

    def _value_char(self, c: str, out: list[ToolCallDelta]) -> None:
        if self.key == "parameters" and self.sent:
            out.append(ToolCallDelta(self.index, None, None, c))
        elif self.key == "parameters" and self.name is not None:
            self.value.append(c)
            self._send(out)
        elif self.key in ("name", "parameters"):
            self.value.append(c)

    def _end_value(self, out: list[ToolCallDelta]) -> None:
        value, self.value = self.value, []
        if self.key == "parameters" and not self.sent:
            self.held = value  # until the name comes
        elif self.key == "name":
            name = _loads("".join(value), None)
            self.name = name if isinstance(name, str) else None
            if self.name is not None and self.held is not None:
                self.value, self.held = self.held, None
                self._send(out)

    def _send(self, out: list[ToolCallDelta]) -> None:
        out.append(ToolCallDelta(self.index, tool_call_id(), self.name, "".join(self.value)))
        self.sent, self.value = True, []


def _loads(text: str, default):
    try:
        return json.loads(text)
    except ValueError:
        return default

"""Qwen3-Coder's tool calls, torch-free (tool_parser_base.py has the rules shared by every
format):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Each value is text, turned into the type the tool's schema gives the parameter (integer,
number, boolean, object, array, null), kept as a string when the schema gives none or the
text does not parse as one. String values stream as they arrive; others go out whole when
their end tag comes.
"""

from __future__ import annotations

import json
import math
import re

from .json_stream import MAX_SCALAR, NUMBER, WS, dump, escape
from .tool_parser_base import MAX_NAME, Bad, Body, Call, ToolParser

_FUNC, _PARAM = "<function=", "<parameter="
_PARAM_END, _FUNC_END, _CALL_END = "</parameter>", "</function>", "</tool_call>"
_VALUE_ENDS = (_PARAM_END, _PARAM, _FUNC_END)  # a value may miss its </parameter>
_INTEGER = re.compile(r"-?[0-9]+")


def _param_types(schema: dict, name: str) -> tuple[str, ...]:
    """The JSON types a tool's schema allows a parameter; ("string",) when it says none."""
    props = schema.get("properties")
    prop = props.get(name) if isinstance(props, dict) else None
    if not isinstance(prop, dict):
        return ("string",)
    kind = prop.get("type")
    if kind is None:
        alts = prop.get("anyOf") or prop.get("oneOf") or []
        kind = [a.get("type") for a in alts if isinstance(a, dict)]
    kinds = tuple(k for k in ([kind] if isinstance(kind, str) else kind or [])
                  if isinstance(k, str))
    return kinds or ("string",)


def _convert(text: str, kinds: tuple[str, ...]):
    """A parameter's text as the first of its schema's types it parses as; else the text."""
    s = text.strip()
    for kind in kinds:
        if kind == "null" and s == "null":
            return None
        if kind == "boolean" and s.lower() in ("true", "false"):
            return s.lower() == "true"
        if kind == "integer" and _INTEGER.fullmatch(s) and len(s) < MAX_SCALAR:
            return int(s)
        if kind == "number" and NUMBER.fullmatch(s) and len(s) < MAX_SCALAR:
            value = json.loads(s)
            if isinstance(value, int) or math.isfinite(value):
                return value
        if kind in ("object", "array"):
            try:
                value = json.loads(s)
            except ValueError:
                continue
            if isinstance(value, dict if kind == "object" else list):
                return value
    return text


class _Qwen3CoderBody(Body):
    def __init__(self, names: dict[str, dict]):
        super().__init__(names)
        self.state = "function"
        self.call: Call | None = None
        self.schema: dict = {}
        self.params: set[str] = set()
        self.kinds: tuple[str, ...] = ()
        self.sent = 0  # value characters sent (string values stream)
        self.searched = 0  # value characters searched for its end

    @property
    def _call(self) -> Call:
        assert self.call is not None, "every state after the name reads an open call"
        return self.call

    def _tag_name(self, tag: str) -> str | None:
        """NAME of a `<tag=NAME>` at buf's start (consumed); None while it may still come."""
        if not self.buf.startswith(tag):
            if tag.startswith(self.buf) and not self.final:
                return None
            raise Bad(self.at)
        end = self.buf.find(">", len(tag))
        name = self.buf[len(tag):end if end >= 0 else len(self.buf)]
        if end < 0:
            if len(name) > MAX_NAME or "\n" in name or self.final:
                raise Bad(self.at)
            return None
        name = name.strip(WS)
        if not name or len(name) > MAX_NAME:
            raise Bad(self.at)
        self.take(end + 1)
        return name

    def _step(self) -> int | None:
        while True:
            state = self.state
            if state != "value" and not self.skip_ws():
                if state == "close" and self.final:  # the output ended at </function>
                    return self._done(self.at)
                return None
            if state == "function":
                name = self._tag_name(_FUNC)
                if name is None:
                    return None
                self.call = Call(self.check_name(name))
                self.call.args, self.call.ready = "{", True
                self.calls.append(self.call)
                self.schema = self.names.get(name) or {}
                self.state = "params"
            elif state == "params":
                if self.buf.startswith(_FUNC_END) or (
                        _FUNC_END.startswith(self.buf) and not _PARAM.startswith(self.buf)):
                    if not self.literal(_FUNC_END):
                        return None
                    self._call.args += "}"
                    self.state = "close"
                    continue
                name = self._tag_name(_PARAM)
                if name is None:
                    return None
                if name in self.params:
                    raise Bad(self.at)
                self.kinds = _param_types(self.schema, name)
                self._call.args += ("," if self.params else "") + dump(name) + ":"
                self.params.add(name)
                if self.kinds == ("string",):
                    self._call.args += '"'
                self.sent = self.searched = 0
                self.state = "value"
            elif state == "value":
                if not self._value():
                    return None
                self.state = "params"
            else:  # close
                if self.buf.startswith(_CALL_END) or (self.final
                                                      and _CALL_END.startswith(self.buf)):
                    self.take(min(len(self.buf), len(_CALL_END)))
                    return self._done(self.at)
                if _CALL_END.startswith(self.buf):
                    return None
                raise Bad(self.at)

    def _done(self, at: int) -> int:
        self._call.complete, self.checkpoint = True, at
        return at

    def _value(self) -> bool:
        """Reads a parameter's value up to its end tag: True once it has ended. The one
        newline after the start tag and the one before the end tag are the template's."""
        buf = self.buf
        ends = [(i, t) for t in _VALUE_ENDS if (i := buf.find(t, self.searched)) >= 0]
        streams = self.kinds == ("string",)
        if ends:
            i, tag = min(ends)
            text = buf[:i]
            lo = 1 if text.startswith("\n") else 0
            hi = len(text) - 1 if len(text) > lo and text.endswith("\n") else len(text)
            if streams:
                self._call.args += escape(text[max(self.sent, lo):hi]) + '"'
            else:
                self._call.args += dump(_convert(text[lo:hi], self.kinds))
            self.take(i + (len(tag) if tag == _PARAM_END else 0))
            return True
        if self.final:
            raise Bad(self.at + len(buf))
        self.searched = max(0, len(buf) - len(_PARAM_END) + 1)
        if streams:
            hold = max((k for t in _VALUE_ENDS for k in range(1, len(t))
                        if buf.endswith(t[:k])), default=0)
            text = buf[:len(buf) - hold]
            if text:
                lo = 1 if text.startswith("\n") else 0
                hi = len(text) - 1 if len(text) > lo and text.endswith("\n") else len(text)
                if hi > max(self.sent, lo):
                    self._call.args += escape(text[max(self.sent, lo):hi])
                    self.sent = hi
        return False


class Qwen3CoderToolParser(ToolParser):
    start_tags = ("<tool_call>",)
    end_tag = "</tool_call>"

    def _new_body(self, tag: str) -> Body:
        return _Qwen3CoderBody(self.names)

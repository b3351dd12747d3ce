"""What every tool-call parser shares, torch-free: the result types, the scan of a
response for call regions, and the rules that keep streaming and whole-text parsing equal.

A response is content with call regions in it, each opened by a format's start tag
(`<tool_call>`, `[TOOL_CALLS]`, `<|python_tag|>`, or for Llama a `{` first thing in the
output). A format's `_Body` reads a region's text and reports the calls in it as they
become known, and where the region ends or breaks. The rules, the same whole or streamed:

- Text outside regions is content, except whitespace touching a call region (the newline
  between a sentence and `<tool_call>`, the blank lines between calls), which is dropped.
- A partial start tag at the end of what has arrived is held back until it is known.
- A region that does not hold a well-formed call is content, its tag and all, and the text
  after its tag is scanned again (it may hold a real tag).
- Streamed, a call is sent once its name is known and its arguments have begun, and its
  arguments as fragments of their compact JSON text as they arrive. `parse()` runs the
  same scan but keeps each call until its region has closed well. So a stream and the whole
  text give the same content and calls for every text whose calls close; a call cut off
  after it was sent (the output ran out of tokens, or turned to garbage mid-call) ends the
  stream with what was sent of it, while `parse()` keeps that text as content.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from .json_stream import WS, JsonError

MAX_NAME = 256  # characters in a function or parameter name


def tool_call_id() -> str:
    """A new call id, OpenAI's shape: "call_" and 24 random hex digits."""
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # compact JSON text of an object


@dataclass(frozen=True)
class ToolCallDelta:
    index: int          # the call's position in this response
    id: str | None      # only on a call's first delta, with its name
    name: str | None
    arguments: str      # the next fragment of ToolCall.arguments ("" allowed)


class Bad(Exception):
    """A region is not a well-formed call; `pos` is where, in the region's text."""

    def __init__(self, pos: int):
        super().__init__(pos)
        self.pos = pos


def tool_schemas(tools: list | None) -> dict[str, dict]:
    """{function name: its `parameters` schema} from OpenAI tool dicts (others skipped)."""
    out = {}
    for tool in tools or ():
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters")
            out[fn["name"]] = params if isinstance(params, dict) else {}
    return out


class Call:
    """One call as a region reveals it. `ready`: may be sent (name known, arguments
    begun); `complete`: its region vouches for it."""

    def __init__(self, name: str | None = None):
        self.name = name
        self.args = ""
        self.ready = False
        self.complete = False


class Body:
    """Reads one region's text (after its start tag). Formats implement `_step`, which
    consumes from `self.buf` and returns None (wants more text), or the region's end (an
    offset into the region's text); it raises Bad where the region breaks. `checkpoint`:
    the offset just past the last complete call, where the region may end if what follows
    breaks (a Llama `;` list, a Mistral JSON list)."""

    def __init__(self, names: dict[str, dict]):
        self.names = names
        self.calls: list = []
        self.checkpoint = 0
        self.buf = ""
        self.at = 0  # offset of buf[0] in the region's text
        self.final = False

    def feed(self, text: str) -> tuple[str, int] | None:
        self.buf += text
        return self._run()

    def finish(self) -> tuple[str, int]:
        self.final = True
        return self._run() or ("bad", self.at + len(self.buf))

    def _run(self) -> tuple[str, int] | None:
        try:
            end = self._step()
        except Bad as e:
            return "bad", e.pos
        return None if end is None else ("end", end)

    def _step(self) -> int | None:
        raise NotImplementedError

    # Helpers for `_step`.
    def take(self, n: int) -> None:
        self.at += n
        self.buf = self.buf[n:]

    def skip_ws(self) -> bool:
        """Drops leading whitespace; True if something else follows."""
        rest = self.buf.lstrip(WS)
        self.take(len(self.buf) - len(rest))
        return bool(rest)

    def literal(self, tag: str) -> bool:
        """Consumes `tag` if buf starts with it (True); False while buf is a prefix of it;
        Bad otherwise."""
        if self.buf.startswith(tag):
            self.take(len(tag))
            return True
        if tag.startswith(self.buf) and not self.final:
            return False
        raise Bad(self.at)

    def json(self, stream) -> bool:
        """Feeds buf to a JsonStream or Envelope; True once its value has ended."""
        try:
            end = stream.feed(self.buf, 0)
        except JsonError as e:
            raise Bad(self.at + e.pos) from None
        self.take(len(self.buf) if end is None else end)
        return end is not None

    def check_name(self, name: object) -> str:
        """A call's name: a non-empty string, one of the request's tools if it has any."""
        if not isinstance(name, str) or not name or (self.names and name not in self.names):
            raise Bad(self.at)
        return name


class _Skip(Body):
    """The rest of a region whose sent call broke: dropped, up to `end_tag` if given."""

    def __init__(self, end_tag: str | None):
        super().__init__({})
        self.end_tag = end_tag

    def _step(self) -> int | None:
        end = self.end_tag
        i = self.buf.find(end) if end else -1
        if end and i >= 0:
            return self.at + i + len(end)
        if self.final:
            return self.at + len(self.buf)
        keep = len(self.end_tag) - 1 if self.end_tag else 0  # a partial end tag
        self.take(max(0, len(self.buf) - keep))
        return None


class ToolParser:
    """A response's tool calls and content, streamed (`feed`, then `finish`) or whole
    (`parse`). Built per choice with the request's tools (OpenAI tool dicts). A subclass
    names its start tags, may allow a bare `{` first thing in the output, and builds a
    `Body` per region."""

    start_tags: tuple[str, ...] = ()
    end_tag: str | None = None  # the tag that closes a region, where the format has one
    bare_start = False  # a `{` first thing in the output opens a region (Llama)

    def __init__(self, tools: list | None = None, *, _whole: bool = False):
        self.tools = tools or []
        self.names = tool_schemas(self.tools)
        self._whole = _whole   # keep calls until their region closes (parse)
        self._pending = ""     # text not yet decided
        self._ws = ""          # content's trailing whitespace, held: a region may follow
        self._after = False    # just after a region: drop leading whitespace
        self._at_start = True  # nothing but whitespace so far
        self._body: Body | None = None
        self._tag = ""         # the open region's tag, and the whitespace dropped before it
        self._before = ""
        self._raw: list[str] = []  # the open region's text, in pieces (joined at its end)
        self._sent: list[int] = []   # the open region's sent calls: argument characters sent
        self._index: list[int] = []  # and their indices in the response
        self._count = 0

    def _new_body(self, tag: str) -> Body:
        raise NotImplementedError

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self._pending += text
        return self._run(final=False)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        return self._run(final=True)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        whole = type(self)(self.tools, _whole=True)
        content, deltas = whole.feed(text)
        rest, more = whole.finish()
        calls: dict[int, list] = {}
        for d in deltas + more:
            if d.id is not None:
                calls[d.index] = [d.id, d.name, d.arguments]
            else:
                calls[d.index][2] += d.arguments
        return content + rest, [ToolCall(*calls[i]) for i in sorted(calls)]

    def _run(self, final: bool) -> tuple[str, list[ToolCallDelta]]:
        out: list[str] = []
        deltas: list[ToolCallDelta] = []
        while True:
            if self._body is None:
                self._scan(out, final)
                if self._body is None:
                    break
            text, self._pending = self._pending, ""
            self._raw.append(text)
            status = self._body.feed(text) if text else None
            if status is None and final:
                status = self._body.finish()
            self._send(deltas, complete_only=self._whole)
            if status is None:
                break
            self._close(status, out, deltas)
        if final:
            out.append(self._ws + self._pending)
            self._ws = self._pending = ""
        return "".join(out), deltas

    def _scan(self, out: list[str], final: bool) -> None:
        """Content until the next region's start (which opens it), or the end of what has
        arrived, holding back whitespace and a partial tag."""
        text = self._pending
        if self._after or self._at_start:
            rest = text.lstrip(WS)
            if self._at_start:
                self._ws += text[:len(text) - len(rest)]
            text = rest
            if not text:
                self._pending = ""
                return
            self._after = False
            if self._at_start:
                self._at_start = False
                if self.bare_start and text[0] == "{":
                    self._open("", self._ws, text)
                    self._ws = ""
                    return
        found = min(((i, t) for t in self.start_tags if (i := text.find(t)) >= 0),
                    default=None)
        if found is not None:
            i, tag = found
            seg = self._ws + text[:i]
            core = seg.rstrip(WS)
            out.append(core)
            self._ws = ""
            self._open(tag, seg[len(core):], text[i + len(tag):])
            return
        hold = 0 if final else max((k for t in self.start_tags for k in range(1, len(t))
                                    if text.endswith(t[:k])), default=0)
        seg = self._ws + text[:len(text) - hold]
        core = seg.rstrip(WS)
        out.append(core)
        self._ws = seg[len(core):]
        self._pending = text[len(text) - hold:]

    def _open(self, tag: str, before: str, rest: str) -> None:
        self._body = self._new_body(tag)
        self._tag, self._before, self._raw, self._pending = tag, before, [], rest
        self._sent, self._index = [], []

    def _send(self, deltas: list[ToolCallDelta], complete_only: bool) -> None:
        """Deltas for the open region's calls: new argument text of those sent, and the
        first delta of each next one that may go out now."""
        assert self._body is not None  # a region is open
        for k, call in enumerate(self._body.calls):
            if k < len(self._sent):
                if len(call.args) > self._sent[k]:
                    deltas.append(ToolCallDelta(self._index[k], None, None,
                                                call.args[self._sent[k]:]))
                    self._sent[k] = len(call.args)
            elif call.complete if complete_only else call.ready:
                self._index.append(self._count)
                self._count += 1
                self._sent.append(len(call.args))
                deltas.append(ToolCallDelta(self._index[k], tool_call_id(), call.name,
                                            call.args))
            else:
                break

    def _close(self, status: tuple[str, int], out: list[str],
               deltas: list[ToolCallDelta]) -> None:
        kind, at = status
        body, self._body = self._body, None
        assert body is not None  # a region was open
        raw = "".join(self._raw)
        if isinstance(body, _Skip):
            self._pending = raw[at:] + self._pending
            self._after = True
            return
        complete = sum(1 for c in body.calls if c.complete)
        if kind == "end" and body.calls:
            rest = raw[at:]
        elif kind == "bad" and len(self._sent) > complete:
            # A call already sent broke: it stops where it is, and the rest of its region
            # (to the format's end tag, else to the end of the output) is dropped.
            self._pending = raw[at:] + self._pending
            self._body, self._raw = _Skip(self.end_tag), []
            return
        elif complete:  # the region ends after its last complete call
            body.calls = body.calls[:complete]
            rest = raw[body.checkpoint:]
        else:  # no call here: the tag is content and the text after it is read again
            out.append(self._ws + self._before + self._tag)
            self._ws = ""
            self._pending = raw + self._pending
            self._after = False
            return
        self._body = body
        self._send(deltas, complete_only=True)
        self._body = None
        self._pending = rest + self._pending
        self._after = True

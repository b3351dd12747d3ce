"""Generation's responses as OpenAI's JSON: whole completions, stream chunks, logprobs in
each endpoint's own shape, usage with cached prompt tokens, and errors.

A whole response is written as JSON a piece at a time (`Renderer.whole_json`), on a
thread: each choice's fields, then its logprobs ROWS rows at a time, never one tree of
Python objects for the whole answer. The event loop gets the interpreter back between
pieces, and the answer costs its JSON text and little more."""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass, field

import grpc

from baton.services.common.finish import FinishReason
from baton.services.rpc.convert import finish_reason_of
from baton.v1 import generation_pb2 as gen

ROWS = 256  # logprob rows written as JSON at a time
# Strict JSON, as Starlette's JSONResponse writes it: a NaN or an infinity raises.
_dumps = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode

# A status code as an HTTP status and OpenAI's error type.
HTTP = {grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
        grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
        grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
        grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
        grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
        grpc.StatusCode.CANCELLED: (499, "cancelled"),
        grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
        grpc.StatusCode.ABORTED: (503, "service_unavailable_error"),
        grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error")}


def error_body(code: grpc.StatusCode, message: str, param: str | None = None,
               err_code: str | None = None) -> tuple[int, dict]:
    status, kind = HTTP.get(code, (500, "server_error"))
    return status, {"error": {"message": message, "type": kind, "param": param,
                              "code": err_code}}


def event(body: dict) -> str:
    """One server-sent event. Strict JSON, as every body Baton sends (Starlette's
    JSONResponse is strict too): a NaN or an infinity raises rather than going out."""
    return f"data: {json.dumps(body, allow_nan=False)}\n\n"


def finish_of(reason: FinishReason | None, stop_reason: str | int | None
              ) -> tuple[str | None, str | int | None]:
    """The one mapping of Baton's finish reason and stop reason to OpenAI's: CONSTRAINT
    (the structured output allows no further token) is an ordinary "stop" there, told by
    stop_reason; the others keep their names."""
    if reason == FinishReason.CONSTRAINT:
        return FinishReason.STOP, FinishReason.CONSTRAINT
    return reason, stop_reason


def param_of(message: str, chat: bool) -> str | None:
    """The request field an INVALID_ARGUMENT message names, in OpenAI's terms."""
    head, _, rest = message.partition(":")
    if head == "sampling":
        return rest.split()[0] if rest.split() else None
    if head.startswith("chat."):  # chat.messages[2].role, chat.tools[0].name, ...
        return head[len("chat."):]
    if head in ("text", "token_ids", "prompt"):
        return "messages" if chat else "prompt"
    return head if head and " " not in head else None


@dataclass
class Choice:
    """What one choice has streamed, for the whole response and for usage."""

    index: int
    texts: list[str] = field(default_factory=list)  # joined once, at the end (`text`)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[gen.TokenLogprobs] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    parsed: ParsedMessage | None = None  # a chat whose output the router parsed

    def add(self, reply: gen.GenerateResponse) -> None:
        d = reply.delta
        self.texts.append(d.text)  # not `text +=`: that copies it all again per token
        if reply.HasField("chat"):
            self.parsed = self.parsed or ParsedMessage()
            self.parsed.add(reply.chat)
        self.token_ids += d.token_ids
        self.logprobs += d.logprobs
        if d.finish_reason:
            self.finish_reason = finish_reason_of(d.finish_reason)
            which = d.WhichOneof("stop_reason")
            self.stop_reason = getattr(d, which) if which else None
        if reply.HasField("usage"):
            self.prompt_tokens = reply.usage.prompt_tokens
            self.cached_tokens = reply.usage.cached_tokens

    @property
    def text(self) -> str:
        return "".join(self.texts)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class Tally:
    """What a streamed choice keeps: its usage counts, never its tokens or logprobs (they
    went out in the chunks)."""

    index: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    def add(self, reply: gen.GenerateResponse) -> None:
        self.completion_tokens += len(reply.delta.token_ids)
        if reply.HasField("usage"):
            self.prompt_tokens = reply.usage.prompt_tokens
            self.cached_tokens = reply.usage.cached_tokens


@dataclass
class ParsedMessage:
    """A chat choice's reasoning, content and tool calls (GenerateResponse.chat), joined:
    the whole message is its stream's pieces put together."""

    reasoning: list[str] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    calls: dict[int, tuple[str, str, list[str]]] = field(default_factory=dict)

    def add(self, chat: gen.ChatDelta) -> None:
        self.reasoning.append(chat.reasoning_content)
        self.content.append(chat.content)
        for d in chat.tool_calls:
            if d.index not in self.calls:
                self.calls[d.index] = (d.id, d.name, [])
            self.calls[d.index][2].append(d.arguments)

    def message(self) -> dict:
        content = "".join(self.content)
        out = {"role": "assistant", "content": content or (None if self.calls else "")}
        reasoning = "".join(self.reasoning)
        if reasoning:
            out["reasoning_content"] = reasoning
        if self.calls:
            out["tool_calls"] = [
                {"id": i, "type": "function", "function": {"name": name,
                                                           "arguments": "".join(args)}}
                for _, (i, name, args) in sorted(self.calls.items())]
        return out


def chat_delta(chat: gen.ChatDelta, first: bool) -> dict:
    """A stream chunk's delta of a parsed chat: what is new of each part."""
    out: dict = {"role": "assistant", "content": chat.content} if first else {}
    if chat.content and not first:
        out["content"] = chat.content
    if chat.reasoning_content:
        out["reasoning_content"] = chat.reasoning_content
    if chat.tool_calls:
        out["tool_calls"] = [
            {"index": d.index, "id": d.id, "type": "function",
             "function": {"name": d.name, "arguments": d.arguments}} if d.id else
            {"index": d.index, "function": {"arguments": d.arguments}}
            for d in chat.tool_calls]
    return out


def usage(choices: list[Choice] | list[Tally], n: int) -> dict:
    """Each prompt counted once though its n choices each ran it (sharing its cache)."""
    prompts = choices[::n]
    prompt = sum(c.prompt_tokens for c in prompts)
    completion = sum(c.completion_tokens for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(c.cached_tokens for c in prompts)}}


class Renderer:
    """One response's ids and shapes: `chat` or completions."""

    def __init__(self, chat: bool, model: str, token_text):
        self.chat = chat
        self.model = model
        self.token_text = token_text  # token id -> its text
        self.echo: list[str] = []  # completions' echo: each choice's prompt text, or none
        self.id = ("chatcmpl-" if chat else "cmpl-") + format(time.time_ns(), "x")
        self.created = int(time.time())

    def _head(self, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat \
            else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def logprobs(self, entries: list[gen.TokenLogprobs], token_ids: list[int],
                 want_top: int) -> dict | None:
        if not entries:
            return None
        rows = []
        for t, lp in zip(token_ids, entries, strict=False):
            by_id = {e.token_id: e.logprob for e in lp.entries}
            top = sorted(by_id.items(), key=lambda kv: -kv[1])[:want_top]
            rows.append((t, by_id.get(t, 0.0), top))
        if self.chat:
            return {"content": [
                {"token": self.token_text(t), "logprob": lp,
                 "bytes": list(self.token_text(t).encode()),
                 "top_logprobs": [{"token": self.token_text(i), "logprob": v,
                                   "bytes": list(self.token_text(i).encode())}
                                  for i, v in top]} for t, lp, top in rows]}
        tokens = [self.token_text(t) for t, _, _ in rows]
        offsets = list(itertools.accumulate((len(x) for x in tokens[:-1]), initial=0)
                       )[:len(tokens)]
        return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in rows],
                "top_logprobs": [{self.token_text(i): v for i, v in top} for _, _, top in rows],
                "text_offset": offsets}  # from the start of these tokens' text

    def whole_json(self, choices: list[Choice], n: int, want_top: int) -> bytes:
        """The whole response as JSON bytes, written a piece at a time (for a thread)."""
        out = [_dumps(self._head(chunk=False))[:-1], ',"choices":[']
        for k, c in enumerate(choices):
            # The choice's own fields, its logprobs put in before its closing brace.
            out += [","] if k else []
            out += [_dumps(self._choice(c))[:-1], ',"logprobs":']
            out += self._logprobs_json(c.logprobs, c.token_ids, want_top)
            out.append("}")
        out += ['],"usage":', _dumps(usage(choices, n)), "}"]
        return "".join(out).encode()

    def _choice(self, c: Choice) -> dict:
        """A whole choice, but for its logprobs."""
        finish, stop_reason = finish_of(c.finish_reason, c.stop_reason)
        out = {"index": c.index, "finish_reason": finish, "stop_reason": stop_reason}
        if self.chat:
            out["message"] = (c.parsed.message() if c.parsed is not None
                              else {"role": "assistant", "content": c.text})
        else:
            out["text"] = (self.echo[c.index] if self.echo else "") + c.text
        return out

    def _logprobs_json(self, entries: list[gen.TokenLogprobs], token_ids: list[int],
                       want_top: int) -> list[str]:
        """`logprobs(entries, token_ids, want_top)` as JSON, ROWS rows at a time (each
        part written before the next is made)."""
        if not entries:
            return ["null"]
        parts = (p for i in range(0, len(entries), ROWS)  # (no part is empty: each a dict)
                 if (p := self.logprobs(entries[i:i + ROWS], token_ids[i:i + ROWS],
                                        want_top)) is not None)
        if self.chat:
            return ['{"content":[', _items(_dumps(p["content"]) for p in parts), "]}"]
        names = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
        columns: dict[str, list[str]] = {name: [] for name in names}
        at = 0  # text_offset runs on from one part to the next
        for p in parts:
            p["text_offset"] = [at + x for x in p["text_offset"]]
            at += sum(map(len, p["tokens"]))
            for name in names:
                columns[name].append(_dumps(p[name]))
        return ["{", ",".join(f'"{name}":[{_items(columns[name])}]' for name in names), "}"]

    def chunk(self, index: int, reply: gen.GenerateResponse, first: bool, want_top: int,
              with_usage: bool) -> dict:
        d = reply.delta
        body = self._head(chunk=True)
        choice = {"index": index, "logprobs": self.logprobs(list(d.logprobs),
                                                           list(d.token_ids), want_top),
                  "finish_reason": finish_of(finish_reason_of(d.finish_reason), None)[0]
                  if d.finish_reason else None}
        if self.chat and reply.HasField("chat"):
            choice["delta"] = chat_delta(reply.chat, first)
        elif self.chat:
            choice["delta"] = {"role": "assistant", "content": d.text} if first else {
                "content": d.text}
        else:
            choice["text"] = (self.echo[index] if self.echo and first else "") + d.text
        body["choices"] = [choice]
        if with_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, choices: list[Choice] | list[Tally], n: int) -> dict:
        body = self._head(chunk=True)
        body["choices"] = []
        body["usage"] = usage(choices, n)
        return body


def _items(arrays) -> str:
    """JSON arrays' items as one array's (without its brackets)."""
    return ",".join(a[1:-1] for a in arrays if a != "[]")

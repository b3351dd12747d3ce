"""What calls return: small frozen dataclasses made from the wire messages, here only."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from baton.v1 import generation_pb2 as gen


def finish_name(number: int) -> str | None:
    """The proto's enum is the client's vocabulary: FINISH_REASON_STOP is 'stop'; None
    while the request goes on (UNSPECIFIED), or for a number these stubs do not know."""
    if number == gen.FINISH_REASON_UNSPECIFIED or number not in gen.FinishReason.values():
        return None
    return gen.FinishReason.Name(number).removeprefix("FINISH_REASON_").lower()


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache


@dataclass(frozen=True)
class Timings:
    """Seconds, as the server measured them; and how the router served the prompt."""

    queue_s: float
    prefill_s: float
    kv_transfer_s: float
    first_token_s: float
    expected_cached_blocks: int = 0  # the router's guess from the workers' KV events
    local_prefill: bool = False  # the decode worker computed the prompt itself


@dataclass(frozen=True)
class ToolCall:
    """A tool call (whole), or a piece of one as it streams: `index` is its place among
    the output's calls; `id` and `name` come on its first piece only; `arguments` is the
    next fragment of its JSON text (whole, on a Completion's)."""

    index: int
    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Chunk:
    """One streamed response: the new tokens and text since the last one.

    `finish_reason` is 'stop', 'length', 'abort', 'constraint' (the structured output
    allows no further token) or 'tool_calls' on the last chunk, else None;
    `stop_reason` the stop string or stop token id that ended it, if one did.
    `logprobs`, when asked for: one {token_id: logprob} per new token, the sampled token
    first, then the top N. `usage` comes on the last chunk, `timings` on the first and last.
    A chat whose output the router parses (tools, a reasoning parser) has `content` (the
    answer's new text; None otherwise: it is `text`), `reasoning_content` and `tool_calls`
    (pieces).
    """

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: tuple[dict[int, float], ...] | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    content: str | None = None
    reasoning_content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True)
class Completion:
    """A whole generation: the chunks joined; the last usage and timings sent."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    stop_reason: str | int | None = None
    logprobs: tuple[dict[int, float], ...] | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    content: str | None = None  # as Chunk's, joined; `tool_calls` whole
    reasoning_content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()

    @staticmethod
    def of(chunks: Iterable[Chunk]) -> Completion:
        chunks = list(chunks)
        last = chunks[-1] if chunks else None
        logprobs = [c.logprobs for c in chunks if c.logprobs is not None]
        calls: dict[int, list] = {}
        for piece in (t for c in chunks for t in c.tool_calls):
            calls.setdefault(piece.index, [piece.index, piece.id, piece.name, []])[3].append(
                piece.arguments)
        parsed = any(c.content is not None for c in chunks)
        return Completion(
            content="".join(c.content or "" for c in chunks) if parsed else None,
            reasoning_content="".join(c.reasoning_content for c in chunks),
            tool_calls=tuple(ToolCall(i, id_, name, "".join(args))
                             for i, id_, name, args in calls.values()),
            request_id=last.request_id if last else "",
            text="".join(c.text for c in chunks),
            token_ids=tuple(t for c in chunks for t in c.token_ids),
            finish_reason=last.finish_reason if last else None,
            stop_reason=last.stop_reason if last else None,
            logprobs=tuple(lp for group in logprobs for lp in group) if logprobs else None,
            usage=next((c.usage for c in reversed(chunks) if c.usage), None),
            timings=next((c.timings for c in reversed(chunks) if c.timings), None))


@dataclass(frozen=True)
class ModelInfo:
    model: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    block_size: int
    dtype: str
    architecture: str
    family: str = ""  # Baton's implementation: llama, mistral, qwen2, qwen3, gemma2, gemma3
    served_model_name: str = ""  # the name the API serves it under


def chunk_of(msg: gen.GenerateResponse) -> Chunk:
    delta = msg.delta
    which = delta.WhichOneof("stop_reason")
    return Chunk(
        request_id=msg.request_id,
        text=delta.text,
        token_ids=tuple(delta.token_ids),
        finish_reason=finish_name(delta.finish_reason),
        stop_reason=getattr(delta, which) if which else None,
        logprobs=tuple({e.token_id: e.logprob for e in lp.entries} for lp in delta.logprobs)
        if delta.logprobs else None,
        usage=Usage(msg.usage.prompt_tokens, msg.usage.completion_tokens,
                    msg.usage.cached_tokens) if msg.HasField("usage") else None,
        timings=Timings(msg.timings.queue_s, msg.timings.prefill_s, msg.timings.kv_transfer_s,
                        msg.timings.first_token_s, msg.timings.expected_cached_blocks,
                        msg.timings.local_prefill) if msg.HasField("timings") else None,
        content=msg.chat.content if msg.HasField("chat") else None,
        reasoning_content=msg.chat.reasoning_content,
        tool_calls=tuple(ToolCall(t.index, t.id, t.name, t.arguments)
                         for t in msg.chat.tool_calls))


def model_info_of(msg: gen.GetModelInfoResponse) -> ModelInfo:
    i = msg.info
    return ModelInfo(i.model, i.max_model_len, i.vocab_size, tuple(i.eos_token_ids),
                     i.block_size, i.dtype, i.architecture, i.family, i.served_model_name)

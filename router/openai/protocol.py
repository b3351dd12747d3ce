"""OpenAI's request bodies (chat and completions), with vLLM's extensions, and what each
becomes: one GenerateRequest per choice. Fields the engine cannot honour are refused
(400, naming them), never silently dropped. Structured output (response_format and
vLLM's guided_* / structured_outputs) is read in structured.py. `Common.sampling` is this
boundary's one conversion of sampling values (convert.sampling_message, straight to the
wire's message)."""

from __future__ import annotations

import uuid
from typing import cast

from pydantic import BaseModel, ConfigDict, Field

from baton.services.common.errors import shown
from baton.services.common.limits import Limits, OverLimit
from baton.services.common.sampling_params import DEFAULTS, StructuredOutput
from baton.services.rpc.convert import sampling_message
from baton.services.rpc.errors import InvalidArgument
from baton.v1 import generation_pb2 as gen

from ..runs import answer_size
from .chat_fields import (
    Tool,
    ToolCall,
    refuse_unknown,
    template_kwargs_of,
    tool_calls_of,
    tool_choice_of,
    tools_of,
)
from .structured import structured_output


class StreamOptions(BaseModel):
    include_usage: bool = False


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # refused by name when set (chat_fields.py)
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's
    tool_call_id: str | None = None  # a tool result's
    reasoning_content: str | None = None  # an assistant's, for templates that show it


def chat_of(messages: list[ChatMessage], tools: list[Tool] | None,
            chat_template_kwargs: dict | None) -> gen.ChatMessages:
    """OpenAI's messages, tools and chat_template_kwargs as the wire's chat: the one
    conversion of a chat completion's and a /tokenize body's (extra_routes.py), so both
    render the same prompt."""
    out = []
    for i, m in enumerate(messages):
        refuse_unknown(m.model_extra, f"messages[{i}].")
        content = m.content if isinstance(m.content, str) else ""
        if isinstance(m.content, list):
            if any(part.type != "text" for part in m.content):
                raise InvalidArgument(f"messages[{i}].content: only text parts are "
                                      "supported")
            content = "".join(part.text or "" for part in m.content)
        out.append(gen.ChatMessage(
            role=m.role, content=content, tool_calls=tool_calls_of(m.tool_calls),
            tool_call_id=m.tool_call_id or "", name=m.name or "",
            reasoning_content=m.reasoning_content or ""))
    return gen.ChatMessages(messages=out, tools=tools_of(tools),
                            chat_template_kwargs=template_kwargs_of(chat_template_kwargs))


class Common(BaseModel):
    """The fields both endpoints take."""

    # Unknown fields are refused by name (refuse_unsupported), but for vLLM's extensions
    # that structured.py reads and a few harmless ones (chat_fields.ALLOWED).
    model_config = ConfigDict(extra="allow")
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(1, ge=1)  # at most --max-n (checked before parsing: body.py)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    priority: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: str | None = None
    min_tokens: int | None = None
    bad_words: list[str] | None = None

    def refuse_unsupported(self) -> None:
        refuse_unknown(self.model_extra)

    def structured(self) -> StructuredOutput | None:
        """The structured-output constraint (response_format, guided_*, ...), or None."""
        return structured_output(self.model_extra or {})

    def sampling(self, max_tokens: int | None, logprobs: int | None, seed: int | None,
                 structured: StructuredOutput | None = None) -> gen.SamplingParams:
        return sampling_message(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
            top_k=self.top_k, min_p=self.min_p, seed=seed,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            stop=self.stop, stop_token_ids=self.stop_token_ids, logprobs=logprobs,
            ignore_eos=self.ignore_eos or None, skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output or None,
            structured=structured, min_tokens=self.min_tokens,
            logit_bias=self.token_bias(), bad_words=self.bad_words)

    def token_bias(self) -> dict[int, float] | None:
        """logit_bias with its keys (OpenAI's token id strings) as ids; the values and
        the ids' range are checked with the other sampling values."""
        if not self.logit_bias:
            return None
        out = {}
        for key, bias in self.logit_bias.items():
            if not (key.strip().isascii() and key.strip().isdigit()):
                raise InvalidArgument(f"logit_bias: key {shown(key)} is not a token id")
            out[int(key)] = bias
        return out

    def check_answer(self, requests: list[gen.GenerateRequest], limits: Limits) -> None:
        """The tokens and logprobs the answer may hold, reckoned as vLLM's users would
        (each prompt's n x max_tokens x (1 + top_logprobs); max_tokens unset in a chat is
        the model's max_new_tokens, else the whole context), against --max-answer-tokens:
        refused before anything runs, naming the fields."""
        max_tokens, top, total = answer_size(requests)
        if total > limits.max_answer_tokens:
            most, top_name = self.answer_fields()
            raise OverLimit(
                f"{most}: {len(requests) // self.n} prompt(s) x n {self.n} x {most} "
                f"{max_tokens} x (1 + {top_name} {top}) = {total} tokens and logprobs "
                f"in the answer, over the limit of {limits.max_answer_tokens} "
                "(--max-answer-tokens)")

    def answer_fields(self) -> tuple[str, str]:
        """The names of the fields that size the answer: (max tokens, top logprobs)."""
        return "max_tokens", "logprobs"

    def choices(self, prompts: list[dict], max_tokens: int | None, logprobs: int | None
                ) -> list[gen.GenerateRequest]:
        """One request per prompt and choice, in OpenAI's order (prompt-major). A seeded
        request gives choice i the seed + i, so its choices differ and repeat."""
        base = uuid.uuid4().hex
        structured = self.structured()
        out = []
        for p, prompt in enumerate(prompts):
            for i in range(self.n):
                seed = None if self.seed is None else self.seed + i
                sampling = self.sampling(max_tokens, logprobs, seed, structured)
                out.append(gen.GenerateRequest(
                    request_id=f"{base}-{p}-{i}", sampling=sampling,
                    priority=self.priority, cache_salt=self.cache_salt or "", **prompt))
        return out


class ChatRequest(Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: str | dict | None = None  # "none", "auto", "required" or a function
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict | None = None  # more variables for the chat template

    def prompt_count(self) -> int:
        return 1

    def answer_fields(self) -> tuple[str, str]:
        most = "max_completion_tokens" if self.max_completion_tokens else "max_tokens"
        return most, "top_logprobs"

    def requests(self, max_model_len: int, defaults: dict | None = None
                 ) -> list[gen.GenerateRequest]:
        """One request per choice; `defaults`: the model's defaults of unset sampling
        values (Intake.sampling_defaults)."""
        self.refuse_unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidArgument("top_logprobs: needs logprobs: true")
        # The chat, and the request's tool fields with it (router/chat.py reads them).
        chat = {"chat": chat_of(self.messages, self.tools, self.chat_template_kwargs),
                **tool_choice_of(self.tool_choice)}
        if self.parallel_tool_calls is not None:
            chat["parallel_tool_calls"] = self.parallel_tool_calls
        # Unset: the model's default (generation_config.json's max_new_tokens), else until
        # the context is full, as vLLM reads it.
        max_tokens = (self.max_completion_tokens or self.max_tokens
                      or (defaults or {}).get("max_tokens") or max_model_len)
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.choices([chat], max_tokens, logprobs)


class CompletionRequest(Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompt_count(self) -> int:
        p = self.prompt
        return len(p) if isinstance(p, list) and p and not isinstance(p[0], int) else 1

    def requests(self, max_model_len: int, defaults: dict | None = None
                 ) -> list[gen.GenerateRequest]:
        """One request per prompt and choice. Unset, max_tokens is 16 whatever the
        model's defaults say, as in vLLM (its completions' own default)."""
        self.refuse_unsupported()
        if self.echo and self.logprobs is not None:
            raise InvalidArgument("echo: not supported with logprobs (the prompt's "
                                  "logprobs are not computed)")
        if self.suffix:
            raise InvalidArgument("suffix: not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidArgument("best_of: only best_of == n is supported")
        p = self.prompt
        if isinstance(p, str):
            prompts = [{"text": p}]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [{"token_ids": gen.TokenIds(ids=cast(list[int], p))}]
        elif p and all(isinstance(x, str) for x in p):
            prompts = [{"text": x} for x in p]
        elif p and all(isinstance(x, list) for x in p):
            prompts = [{"token_ids": gen.TokenIds(ids=cast(list[int], x))} for x in p]
        else:
            raise InvalidArgument("prompt: empty")
        return self.choices(prompts, self.max_tokens or DEFAULTS["max_tokens"], self.logprobs)

    def echo_texts(self, decode) -> list[str]:
        """With echo, what each request's text starts with: its prompt (token ids through
        `decode`), in the order of `requests` (each prompt n times); else []."""
        if not self.echo:
            return []
        p = self.prompt
        if isinstance(p, str) or all(isinstance(x, int) for x in p):
            p = [p]
        texts = [x if isinstance(x, str) else decode(x) for x in p]
        return [t for t in texts for _ in range(self.n)]

"""OpenAI's request bodies (chat and completions), with vLLM's extensions, and what each
becomes: one GenerateRequest per choice. Fields the engine cannot honour are refused
(400, naming them), never silently dropped. Structured output (response_format and
vLLM's guided_* / structured_outputs) is read in structured.py. `Common.sampling` is this
boundary's one conversion of sampling values (convert.sampling_message, straight to the
wire's message)."""

from __future__ import annotations

import uuid

from pydantic import BaseModel, ConfigDict, Field

from baton.router.openai.structured import structured_output
from baton.services.common.sampling_params import StructuredOutput
from baton.services.rpc.convert import sampling_message
from baton.services.rpc.errors import InvalidArgument
from baton.v1 import generation_pb2 as gen


class StreamOptions(BaseModel):
    include_usage: bool = False


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[ContentPart] | None = None


class Common(BaseModel):
    """The fields both endpoints take."""

    model_config = ConfigDict(extra="allow")  # unknown fields are ignored, as vLLM does
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

    def refuse_unsupported(self) -> None:
        if self.logit_bias:
            raise InvalidArgument("logit_bias: not supported")
        for name in ("tools", "functions"):
            if (self.model_extra or {}).get(name):
                raise InvalidArgument(f"{name}: not supported yet")

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
            structured=structured)

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

    def prompt_count(self) -> int:
        return 1

    def requests(self, max_model_len: int) -> list[gen.GenerateRequest]:
        self.refuse_unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidArgument("top_logprobs: needs logprobs: true")
        messages = []
        for i, m in enumerate(self.messages):
            content = m.content if isinstance(m.content, str) else ""
            if isinstance(m.content, list):
                if any(part.type != "text" for part in m.content):
                    raise InvalidArgument(f"messages[{i}].content: only text parts are "
                                          "supported")
                content = "".join(part.text or "" for part in m.content)
            messages.append(gen.ChatMessage(role=m.role, content=content))
        chat = {"chat": gen.ChatMessages(messages=messages)}
        # Unset: until the context is full, as OpenAI and vLLM read it.
        max_tokens = self.max_completion_tokens or self.max_tokens or max_model_len
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

    def requests(self, max_model_len: int) -> list[gen.GenerateRequest]:
        self.refuse_unsupported()
        if self.echo:
            raise InvalidArgument("echo: not supported")
        if self.suffix:
            raise InvalidArgument("suffix: not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidArgument("best_of: only best_of == n is supported")
        p = self.prompt
        if isinstance(p, str):
            prompts = [{"text": p}]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [{"token_ids": gen.TokenIds(ids=p)}]
        elif p and all(isinstance(x, str) for x in p):
            prompts = [{"text": x} for x in p]
        elif p and all(isinstance(x, list) for x in p):
            prompts = [{"token_ids": gen.TokenIds(ids=x)} for x in p]
        else:
            raise InvalidArgument("prompt: empty")
        return self.choices(prompts, self.max_tokens or 16, self.logprobs)

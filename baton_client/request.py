"""Requests from keyword arguments: one per SamplingParams field of the proto."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from baton.v1 import generation_pb2 as gen

SAMPLING_FIELDS = frozenset(f.name for f in gen.SamplingParams.DESCRIPTOR.fields)

Message = Mapping[str, str] | tuple[str, str]  # {"role": ..., "content": ...} or a pair


def generate_request(
    prompt: str | None = None, *,
    token_ids: Sequence[int] | None = None,
    messages: Iterable[Message] | None = None,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    seed: int | None = None,
    repetition_penalty: float | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    stop: str | Iterable[str] | None = None,
    stop_token_ids: Iterable[int] | None = None,
    ignore_eos: bool = False,
    logprobs: int | None = None,
    skip_special_tokens: bool | None = None,
    include_stop_str_in_output: bool = False,
    request_id: str = "",
    priority: int = 0,
    cache_salt: str = "",
) -> gen.GenerateRequest:
    """A GenerateRequest. Exactly one of `prompt` (text), `token_ids` or `messages` (chat);
    an unset sampling field takes the server's default (max_tokens 16, temperature 1.0:
    pass temperature=0 for greedy)."""
    sampling = {k: v for k, v in locals().items() if k in SAMPLING_FIELDS and v is not None}
    if isinstance(sampling.get("stop"), str):
        sampling["stop"] = [sampling["stop"]]
    request = gen.GenerateRequest(sampling=gen.SamplingParams(**sampling),
                                  request_id=request_id, priority=priority,
                                  cache_salt=cache_salt)
    which = _one_prompt(prompt, token_ids, messages)
    if which == "text":
        request.text = prompt
    elif which == "token_ids":
        request.token_ids.ids.extend(token_ids)
    else:
        request.chat.CopyFrom(chat_of(messages))
    return request


def tokenize_request(text: str | None = None, *,
                     messages: Iterable[Message] | None = None) -> gen.TokenizeRequest:
    if (text is None) == (messages is None):
        raise TypeError("tokenize() takes exactly one of text or messages=")
    if text is not None:
        return gen.TokenizeRequest(text=text)
    return gen.TokenizeRequest(chat=chat_of(messages))


def chat_of(messages: Iterable[Message]) -> gen.ChatMessages:
    out = gen.ChatMessages()
    for m in messages:
        role, content = (m["role"], m["content"]) if isinstance(m, Mapping) else m
        out.messages.add(role=role, content=content)
    return out


def _one_prompt(prompt, token_ids, messages) -> str:
    given = [name for name, value in (("text", prompt), ("token_ids", token_ids),
                                      ("messages", messages)) if value is not None]
    if len(given) != 1:
        raise TypeError("give exactly one of a prompt, token_ids= or messages=; "
                        f"got {given or 'none'}")
    return given[0]

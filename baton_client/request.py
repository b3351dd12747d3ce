"""Requests from keyword arguments: one per SamplingParams field of the proto."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence

from baton.v1 import generation_pb2 as gen
from baton_client.chat import chat_of, tool_choice_of

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
    structured_output: gen.StructuredOutput | Mapping[str, object] | None = None,
    min_tokens: int | None = None,
    logit_bias: Mapping[int, float] | None = None,
    bad_words: str | Iterable[str] | None = None,
    request_id: str = "",
    priority: int = 0,
    cache_salt: str = "",
    tools: Iterable[Mapping] | None = None,
    tool_choice: str | Mapping | None = None,
    parallel_tool_calls: bool | None = None,
    chat_template_kwargs: Mapping | None = None,
) -> gen.GenerateRequest:
    """A GenerateRequest. Exactly one of `prompt` (text), `token_ids` or `messages` (chat);
    an unset sampling field takes the server's default (max_tokens 16, temperature 1.0:
    pass temperature=0 for greedy). `structured_output` constrains the output: a
    StructuredOutput message or a dict with one key: {"json_schema": schema} (a dict or
    its JSON text), {"json_object": True}, {"regex": "..."}, {"grammar": "<GBNF>"} or
    {"choice": ["yes", "no"]}. A finish_reason of 'constraint' means it allowed no more.
    `min_tokens`: no EOS, stop id or stop string before that many tokens; `logit_bias`:
    {token id: bias in [-100, 100]}; `bad_words`: words the output never contains.
    With `messages`: `tools` (OpenAI's function tools), `tool_choice` ("none", "auto",
    "required" or {"type": "function", "function": {"name": ...}}), `parallel_tool_calls`
    and `chat_template_kwargs` (e.g. {"enable_thinking": False}); the chunks then carry
    `content`, `reasoning_content` and `tool_calls` as the router parsed them."""
    sampling = {k: v for k, v in locals().items() if k in SAMPLING_FIELDS and v is not None}
    for name in ("stop", "bad_words"):
        if isinstance(sampling.get(name), str):
            sampling[name] = [sampling[name]]
    if structured_output is not None:
        sampling["structured_output"] = structured_of(structured_output)
    request = gen.GenerateRequest(sampling=gen.SamplingParams(**sampling),
                                  request_id=request_id, priority=priority,
                                  cache_salt=cache_salt)
    _check_one_prompt(prompt, token_ids, messages)
    if prompt is not None:
        request.text = prompt
    elif token_ids is not None:
        request.token_ids.ids.extend(token_ids)
    elif messages is not None:
        request.chat.CopyFrom(chat_of(messages, tools, chat_template_kwargs))
    if tool_choice is not None:
        request.tool_choice.CopyFrom(tool_choice_of(tool_choice))
    if parallel_tool_calls is not None:
        request.parallel_tool_calls = parallel_tool_calls
    return request


def structured_of(value: gen.StructuredOutput | Mapping[str, object]) -> gen.StructuredOutput:
    """A StructuredOutput message from itself or from a dict with exactly one of its
    constraint fields (`choice` a list of strings); TypeError otherwise. The server checks
    the content (a schema that is not JSON is INVALID_ARGUMENT)."""
    if isinstance(value, gen.StructuredOutput):
        if value.WhichOneof("constraint") is None:
            raise TypeError("structured_output: no constraint set")
        return value
    keys = [f.name for f in gen.StructuredOutput.DESCRIPTOR.oneofs_by_name["constraint"].fields]
    if not isinstance(value, Mapping) or len(value) != 1 or next(iter(value)) not in keys:
        raise TypeError(f"structured_output: a StructuredOutput or a dict with one key of "
                        f"{keys}, got {value!r}")
    (key, item), = value.items()
    if key == "choice":
        if isinstance(item, str) or not isinstance(item, Iterable):
            raise TypeError(f"structured_output: choice must be a list of strings, got {item!r}")
        return gen.StructuredOutput(choice=gen.Choices(choices=list(item)))
    if key == "json_object":
        if item is not True:
            raise TypeError(f"structured_output: json_object must be True, got {item!r}")
        return gen.StructuredOutput(json_object=True)
    if key == "json_schema" and isinstance(item, Mapping):
        item = json.dumps(item)  # a schema as a dict: sent as its JSON text
    if not isinstance(item, str):
        raise TypeError(f"structured_output: {key} must be a string, got {item!r}")
    if key == "regex":
        return gen.StructuredOutput(regex=item)
    if key == "grammar":
        return gen.StructuredOutput(grammar=item)
    return gen.StructuredOutput(json_schema=item)


def tokenize_request(text: str | None = None, *,
                     messages: Iterable[Message] | None = None) -> gen.TokenizeRequest:
    if text is not None and messages is None:
        return gen.TokenizeRequest(text=text)
    if messages is not None and text is None:
        return gen.TokenizeRequest(chat=chat_of(messages))
    raise TypeError("tokenize() takes exactly one of text or messages=")


def _check_one_prompt(prompt, token_ids, messages) -> None:
    given = [name for name, value in (("text", prompt), ("token_ids", token_ids),
                                      ("messages", messages)) if value is not None]
    if len(given) != 1:
        raise TypeError("give exactly one of a prompt, token_ids= or messages=; "
                        f"got {given or 'none'}")

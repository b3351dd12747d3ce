"""A chat request on the router's one path (gRPC Generate and the OpenAI routes alike):
its messages, tools and template variables checked, and its tool_choice and the router's
reasoning parser turned into a constraint and a per-choice output parser.

    check_chat   the messages (roles, tool calls, tool results), the tools, the
                 chat_template_kwargs -> Chat, what the template gets; INVALID_ARGUMENT
                 naming the first bad field
    plan         tool_choice and the reasoning parser -> the request as the workers get
                 it (REQUIRED or a named function: the tools' JSON schema as its
                 constraint; with a reasoning parser: any constraint starts after the
                 reasoning's end marker) and a ChatOutput factory (chat_output.py)

Each chat gets one tool-call parse and one reasoning parse, here, for both APIs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from baton.services.common import constraint_limits
from baton.services.common.errors import shown
from baton.services.common.limits import (
    MAX_TEMPLATE_KWARGS_CHARS,
    MAX_TOOL_CALLS,
    MAX_TOOLS,
    Limits,
)
from baton.services.common.reasoning import REASONING_PARSERS
from baton.services.common.sampling_params import StructuredOutput
from baton.services.common.tool_parsers import TOOL_PARSERS
from baton.services.rpc.convert import structured_message
from baton.services.rpc.errors import InvalidArgument
from baton.v1 import generation_pb2 as gen

from .chat_output import ChatOutput, NamedCall, RequiredCalls

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
NO_PARAMETERS = {"type": "object", "properties": {}}
MODE = {gen.TOOL_CHOICE_MODE_NONE: "none", gen.TOOL_CHOICE_MODE_AUTO: "auto",
        gen.TOOL_CHOICE_MODE_REQUIRED: "required"}


@dataclass(frozen=True)
class ChatSettings:
    """The router's parsers: --tool-call-parser, --enable-auto-tool-choice and
    --reasoning-parser (vLLM's flags)."""

    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        for name, known, flag in ((self.tool_call_parser, TOOL_PARSERS, "tool-call-parser"),
                                  (self.reasoning_parser, REASONING_PARSERS,
                                   "reasoning-parser")):
            if name is not None and name not in known:
                raise ValueError(f"--{flag}: {name!r} is not one of {', '.join(known)}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")


@dataclass
class Chat:
    """What the chat template gets: messages and tools in OpenAI's (and transformers')
    shape, and the request's template variables."""

    messages: list[dict]
    tools: list[dict] = field(default_factory=list)
    template_kwargs: dict = field(default_factory=dict)


def check_chat(chat: gen.ChatMessages, max_chars: int, limits: Limits,
               max_chars_per_token: int = 64) -> Chat:
    """The chat as the template takes it, or InvalidArgument naming the first bad field.
    Every string the template may render counts against --max-prompt-chars, and against
    what `max_chars` (the model's length) can hold: message contents, names, reasoning,
    tool call ids, names and arguments, tool result ids and tool schemas (the template
    variables have a bound of their own, MAX_TEMPLATE_KWARGS_CHARS)."""
    if not chat.messages:
        raise InvalidArgument("chat.messages: empty; send at least one message")
    limits.check("max_messages", len(chat.messages), "chat.messages")
    if len(chat.tools) > MAX_TOOLS:
        raise InvalidArgument(f"chat.tools: {len(chat.tools)} tools, over the limit of "
                              f"{MAX_TOOLS}")
    calls = sum(len(m.tool_calls) for m in chat.messages)
    if calls > MAX_TOOL_CALLS:
        raise InvalidArgument(f"chat.messages: {calls} tool calls, over the limit of "
                              f"{MAX_TOOL_CALLS}")
    total = 0
    for i, m in enumerate(chat.messages):
        if m.role not in CHAT_ROLES:
            raise InvalidArgument(f"chat.messages[{i}].role: {shown(m.role)} is not one "
                                  f"of {', '.join(CHAT_ROLES)}")
        total += (len(m.content) + len(m.reasoning_content) + len(m.name)
                  + len(m.tool_call_id) + sum(len(c.arguments) + len(c.name) + len(c.id)
                                              for c in m.tool_calls))
    total += sum(len(t.name) + len(t.description) + len(t.parameters) for t in chat.tools)
    limits.check("max_prompt_chars", total, "chat.messages")
    if total > max_chars:
        raise InvalidArgument(f"chat.messages: {total} characters of content cannot fit in "
                              f"{max_chars // max_chars_per_token} tokens")
    return Chat([_message(i, m) for i, m in enumerate(chat.messages)], _tools(chat.tools),
                _template_kwargs(chat.chat_template_kwargs))


def _message(i: int, m: gen.ChatMessage) -> dict:
    out: dict = {"role": m.role, "content": m.content}
    if m.tool_calls:
        if m.role != "assistant":
            raise InvalidArgument(f"chat.messages[{i}].tool_calls: only an assistant "
                                  "message calls tools")
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.name, "arguments": _arguments(c.arguments)}} for c in m.tool_calls]
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.name:
        out["name"] = m.name
    if m.reasoning_content:
        out["reasoning_content"] = m.reasoning_content
    return out


def _arguments(text: str):
    """A call's arguments for the template: the object its JSON text holds, as
    transformers' templates expect (and vLLM passes them); other text as it is."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return text
    return value if isinstance(value, dict) else text


def _tools(tools) -> list[dict]:
    out, seen = [], set()
    for i, t in enumerate(tools):
        where = f"chat.tools[{i}]"
        if not TOOL_NAME.fullmatch(t.name):
            raise InvalidArgument(f"{where}.name: {shown(t.name)} is not 1 to 64 letters, "
                                  "digits, '_' or '-'")
        if t.name in seen:
            raise InvalidArgument(f"{where}.name: {shown(t.name)} is named twice")
        seen.add(t.name)
        function: dict = {"name": t.name}
        if t.description:
            function["description"] = t.description
        if t.parameters:
            function["parameters"] = _json_object(f"{where}.parameters", t.parameters)
        out.append({"type": "function", "function": function})
    return out


def _json_object(where: str, text: str) -> dict:
    try:
        constraint_limits.check("json", text, ())  # size and depth, before the parse
        value = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise InvalidArgument(f"{where}: not a JSON object ({e})") from None
    if not isinstance(value, dict):
        raise InvalidArgument(f"{where}: must be a JSON object, got {type(value).__name__}")
    return value


def _template_kwargs(text: str) -> dict:
    if not text:
        return {}
    where = "chat.chat_template_kwargs"
    if len(text) > MAX_TEMPLATE_KWARGS_CHARS:
        raise InvalidArgument(f"{where}: {len(text)} characters, over the limit of "
                              f"{MAX_TEMPLATE_KWARGS_CHARS}")
    value = _json_object(where, text)
    bad = next((k for k in value if not k.isidentifier()), None)
    if bad is not None:
        raise InvalidArgument(f"{where}: {shown(bad)} is not a template variable name")
    return value


def tool_mode(request: gen.GenerateRequest) -> str:
    """"none", "auto", "required" or "function" (tool_choice names one)."""
    choice = request.tool_choice
    which = choice.WhichOneof("choice")
    if which == "function":
        return "function"
    if which == "mode" and choice.mode in MODE:
        return MODE[choice.mode]
    has_tools = request.WhichOneof("prompt") == "chat" and len(request.chat.tools) > 0
    return "auto" if has_tools else "none"


def plan(request: gen.GenerateRequest, chat: Chat | None, prompt_ids: list[int],
         settings: ChatSettings, marker_ids: Callable[[str], list[int]]
         ) -> tuple[gen.GenerateRequest, Callable[[], ChatOutput] | None]:
    """The request as the workers get it (a copy when it changes: tool_choice's
    constraint, the reasoning's end marker), and what makes a choice's output parser
    (None: its text is its content as it is)."""
    mode = tool_mode(request)
    names = [t["function"]["name"] for t in chat.tools] if chat is not None else []
    if mode != "none" and not names:
        raise InvalidArgument("tool_choice: the request has no tools (chat.tools)")
    if mode == "auto" and not settings.enable_auto_tool_choice:  # (it needs a parser)
        raise InvalidArgument('tool_choice: "auto" needs the router to run with '
                              "--enable-auto-tool-choice and --tool-call-parser")
    constraint = None
    tools = chat.tools if chat is not None else []
    if mode in ("required", "function"):
        if request.sampling.HasField("structured_output"):
            raise InvalidArgument("tool_choice: a named function or \"required\" is a "
                                  "constraint of its own; drop the structured output")
        constraint = _tool_constraint(request, tools, mode)
    reasoning = settings.reasoning_parser if chat is not None else None
    end_ids = marker_ids(REASONING_PARSERS[reasoning].end_marker) if reasoning else []
    if reasoning and _closed(prompt_ids, end_ids):
        reasoning = None  # the template closed the thinking itself (enable_thinking off)
    if constraint is not None or (reasoning and request.sampling.HasField(
            "structured_output")):
        request = _copy(request)
        if constraint is not None:
            request.sampling.structured_output.CopyFrom(structured_message(constraint))
        if reasoning:
            request.sampling.structured_output.start_after_token_ids[:] = end_ids
    if mode == "none" and not reasoning:
        return request, None

    def make() -> ChatOutput:
        if mode == "auto":
            assert settings.tool_call_parser  # "auto" needs it (refused above without)
            calls = TOOL_PARSERS[settings.tool_call_parser](tools)
        elif mode == "function":
            calls = NamedCall(request.tool_choice.function)
        elif mode == "required":
            calls = RequiredCalls()
        else:
            calls = None
        return ChatOutput(REASONING_PARSERS[reasoning]() if reasoning else None, calls)

    return request, make


def _closed(prompt_ids: list[int], end_ids: list[int]) -> bool:
    """Whether the prompt's last few tokens hold the reasoning's end marker: the template
    opened and closed the thinking itself (Qwen3's enable_thinking false), so the output
    is all answer."""
    if not end_ids:
        return False
    tail = prompt_ids[-(len(end_ids) + 4):]
    return any(tail[i:i + len(end_ids)] == end_ids for i in range(len(tail)))


def _copy(request: gen.GenerateRequest) -> gen.GenerateRequest:
    out = gen.GenerateRequest()
    out.CopyFrom(request)
    return out


def _tool_constraint(request: gen.GenerateRequest, tools: list[dict], mode: str
                     ) -> StructuredOutput:
    """A named function: its parameters schema, the output being its arguments.
    REQUIRED: an array of {"name": <a tool's>, "parameters": <its schema>}, one item
    unless parallel_tool_calls."""
    params = {t["function"]["name"]: t["function"].get("parameters", NO_PARAMETERS)
              for t in tools}
    if mode == "function":
        name = request.tool_choice.function
        if name not in params:
            raise InvalidArgument(f"tool_choice: no tool is named {shown(name)}")
        schema = params[name]
    else:
        one = [{"type": "object", "properties": {"name": {"const": name},
                                                 "parameters": schema},
                "required": ["name", "parameters"], "additionalProperties": False}
               for name, schema in params.items()]
        schema = {"type": "array", "minItems": 1,
                  "items": one[0] if len(one) == 1 else {"anyOf": one}}
        parallel = (not request.HasField("parallel_tool_calls")
                    or request.parallel_tool_calls)
        if not parallel:
            schema["maxItems"] = 1
    try:
        return StructuredOutput("json", json.dumps(schema))
    except ValueError as e:
        raise InvalidArgument(f"tools: as a constraint, {e}") from None

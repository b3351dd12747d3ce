"""The parts of an OpenAI chat body beyond plain messages, as the wire's: tools, tool_choice,
assistant messages' tool_calls, tool results, reasoning_content and chat_template_kwargs
(router/chat.py checks them for both APIs). And the one rule for fields Baton does not
know: a 400 naming the field, never a silent drop, but for the few in ALLOWED (docs/api.md,
"Unknown fields"), which change nothing Baton does. A field sent as null is unset, as
OpenAI reads it."""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel

from baton.services.common import constraint_limits
from baton.services.rpc.errors import InvalidArgument
from baton.v1 import generation_pb2 as gen

from .structured import GUIDED

# Fields Baton takes and ignores, each harmless to ignore: it changes nothing a model or
# the server would do for this request.
ALLOWED = {
    "metadata": "tags for OpenAI's stored completions; Baton stores nothing",
    "store": "asks OpenAI to store the completion; Baton stores nothing",
    "service_tier": "OpenAI's billing tier; Baton has one",
}
# vLLM's extensions that structured.py reads from the body's extra fields.
EXTENSIONS = frozenset({"response_format", "structured_outputs", "guided_whitespace_pattern",
                        *GUIDED})
MODES = {"none": gen.TOOL_CHOICE_MODE_NONE, "auto": gen.TOOL_CHOICE_MODE_AUTO,
         "required": gen.TOOL_CHOICE_MODE_REQUIRED}


def refuse_unknown(extra: dict | None, where: str = "") -> None:
    """InvalidArgument naming the first field that is neither Baton's, nor a vLLM
    extension it reads, nor ALLOWED (`where`: the field's parent, "messages[0].")."""
    known = EXTENSIONS | set(ALLOWED) if not where else set()
    for name, value in (extra or {}).items():
        if value is not None and name not in known:
            raise InvalidArgument(f"{where}{name}: unknown field; Baton does not serve it "
                                  "(docs/api.md, \"Unknown fields\")")


class Function(BaseModel):
    name: str
    description: str | None = None
    parameters: dict | None = None
    # Taken: a named tool_choice and "required" always enforce the schema; "auto"
    # does not (docs/api.md, "Tool calling").
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: Function


class CalledFunction(BaseModel):
    name: str
    arguments: str | dict  # JSON text, as OpenAI sends it (an object is taken too)


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


def tools_of(tools: list[Tool] | None) -> list[gen.Tool]:
    out = []
    for i, t in enumerate(tools or ()):
        f = t.function
        parameters = ""
        if f.parameters is not None:
            try:
                constraint_limits.check_json_value(f.parameters)  # before the encoder
            except ValueError as e:
                raise InvalidArgument(f"tools[{i}].function.parameters: {e}") from None
            parameters = json.dumps(f.parameters)
        out.append(gen.Tool(name=f.name, description=f.description or "",
                            parameters=parameters))
    return out


def tool_calls_of(calls: list[ToolCall] | None) -> list[gen.ToolCall]:
    return [gen.ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments
                         if isinstance(c.function.arguments, str)
                         else json.dumps(c.function.arguments)) for c in calls or ()]


def tool_choice_of(value) -> dict:
    """The GenerateRequest fields of OpenAI's tool_choice (none: unset)."""
    if value is None:
        return {}
    if isinstance(value, str) and value in MODES:
        return {"tool_choice": gen.ToolChoice(mode=MODES[value])}
    function = value.get("function") if isinstance(value, dict) else None
    if (isinstance(value, dict) and value.get("type") == "function"
            and isinstance(function, dict) and isinstance(function.get("name"), str)):
        return {"tool_choice": gen.ToolChoice(function=function["name"])}
    raise InvalidArgument('tool_choice: must be "none", "auto", "required" or '
                          '{"type": "function", "function": {"name": ...}}')


def template_kwargs_of(value: dict | None) -> str:
    """chat_template_kwargs as the wire's JSON text (its size is checked by chat.py)."""
    if not value:
        return ""
    try:
        constraint_limits.check_json_value(value)  # depth, before the encoder recurses
    except ValueError:
        raise InvalidArgument("chat_template_kwargs: nested too deeply") from None
    return json.dumps(value)

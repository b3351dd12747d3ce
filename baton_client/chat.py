"""Chat requests from OpenAI-shaped values: messages (with an assistant's `tool_calls`, a
tool's `tool_call_id` and `name`, `reasoning_content`), tools, tool_choice and the
template's variables, as the proto's messages."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping

from baton.v1 import generation_pb2 as gen

MODES = {"none": gen.TOOL_CHOICE_MODE_NONE, "auto": gen.TOOL_CHOICE_MODE_AUTO,
         "required": gen.TOOL_CHOICE_MODE_REQUIRED}


def chat_of(messages: Iterable, tools: Iterable[Mapping] | None = None,
            chat_template_kwargs: Mapping | None = None) -> gen.ChatMessages:
    """Messages are {"role", "content", ...} dicts (OpenAI's) or (role, content) pairs;
    tools OpenAI's {"type": "function", "function": {...}} or the function itself."""
    out = gen.ChatMessages()
    for m in messages:
        if not isinstance(m, Mapping):
            role, content = m
            out.messages.add(role=role, content=content)
            continue
        msg = out.messages.add(role=m["role"], content=m.get("content") or "",
                               tool_call_id=m.get("tool_call_id") or "",
                               name=m.get("name") or "",
                               reasoning_content=m.get("reasoning_content") or "")
        for call in m.get("tool_calls") or ():
            f = call.get("function", call)
            arguments = f.get("arguments", "{}")
            msg.tool_calls.add(id=call.get("id", ""), name=f["name"],
                               arguments=arguments if isinstance(arguments, str)
                               else json.dumps(arguments))
    for tool in tools or ():
        f = tool.get("function", tool)
        parameters = f.get("parameters")
        out.tools.add(name=f["name"], description=f.get("description") or "",
                      parameters="" if parameters is None else json.dumps(parameters))
    if chat_template_kwargs:
        out.chat_template_kwargs = json.dumps(dict(chat_template_kwargs))
    return out


def tool_choice_of(value: str | Mapping) -> gen.ToolChoice:
    """"none", "auto", "required", a function's name as {"type": "function",
    "function": {"name": ...}} or {"name": ...}; TypeError otherwise."""
    if isinstance(value, str) and value in MODES:
        return gen.ToolChoice(mode=MODES[value])
    if isinstance(value, Mapping):
        f = value.get("function", value)
        if isinstance(f, Mapping) and isinstance(f.get("name"), str):
            return gen.ToolChoice(function=f["name"])
    raise TypeError(f'tool_choice: "none", "auto", "required" or a function\'s name as '
                    f'{{"type": "function", "function": {{"name": ...}}}}, got {value!r}')

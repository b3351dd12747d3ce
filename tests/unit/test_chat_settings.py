"""The router's chat settings and what they make of a request, without a model: the flags
(--tool-call-parser, --enable-auto-tool-choice, --reasoning-parser, --chat-template) and
their refusals, the constraint a tool_choice becomes, where a constraint starts with a
reasoning parser, the "required" array streamed into calls, and the wire's bounds on
tools and tool calls."""

from __future__ import annotations

import json
import random

import pytest

from baton.router.chat import MAX_TOOLS, Chat, ChatSettings, check_chat, plan
from baton.router.chat_output import RequiredCalls
from baton.router.config import RouterConfig
from baton.router.wire import check_generate
from baton.services.common.limits import Limits
from baton.services.common.tokenizer import Tokenizer, read_chat_template
from baton.services.engine.config import EngineConfig
from baton.services.rpc.convert import structured_of
from baton.services.rpc.errors import InvalidArgument
from baton.v1 import generation_pb2 as gen
from tests.unit.test_cli_flags import _configs

SCHEMA = {"type": "object", "properties": {"x": {"type": "integer"}}}
TOOLS = [gen.Tool(name="f", parameters=json.dumps(SCHEMA)), gen.Tool(name="g")]
END = [9, 10]  # the reasoning's end marker's ids, as a tokenizer would give them


def chat_request(**kw) -> gen.GenerateRequest:
    chat = gen.ChatMessages(messages=[gen.ChatMessage(role="user", content="hi")],
                            tools=kw.pop("tools", TOOLS))
    return gen.GenerateRequest(chat=chat, **kw)


def planned(request: gen.GenerateRequest, settings: ChatSettings, prompt=(1, 2, 3)):
    chat = check_chat(request.chat, 10**6, Limits())
    return plan(request, chat, list(prompt), settings, lambda text: END)


def test_the_flags_reach_the_router_and_the_engine(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    flags = ("--tool-call-parser", "hermes", "--enable-auto-tool-choice",
             "--reasoning-parser", "qwen3", "--chat-template", str(template))
    for role in ("router", "colocated"):
        router = RouterConfig(**_configs(role, *flags, "--decode", "d:1")["router"]
                              if role == "router" else _configs(role, *flags)["router"])
        assert router.chat_settings() == ChatSettings("hermes", True, "qwen3")
        assert router.chat_template == str(template)
    engine = EngineConfig(**_configs("prefill", "--chat-template", str(template))["engine"])
    assert engine.chat_template == str(template)
    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        RouterConfig(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="reasoning-parser"):
        RouterConfig(reasoning_parser="nope")


def test_a_chat_template_from_a_file_or_inline_replaces_the_models(tok, tmp_path):
    template = "{% for m in messages %}[{{ m.content }}]{% endfor %}"
    path = tmp_path / "t.jinja"
    path.write_text(template)
    assert read_chat_template(str(path)) == read_chat_template(template) == template
    flagged = Tokenizer(tok, str(path))
    assert flagged.apply_chat_template([{"role": "user", "content": "hi"}]) == \
        flagged.encode("[hi]")
    with pytest.raises(ValueError, match="neither a file nor a jinja template"):
        Tokenizer(tok, str(tmp_path / "missing.jinja"))


def test_a_named_function_or_required_becomes_the_constraint():
    request, make = planned(chat_request(tool_choice=gen.ToolChoice(function="f")),
                            ChatSettings())
    assert json.loads(request.sampling.structured_output.json_schema) == SCHEMA
    assert make is not None
    request, _ = planned(chat_request(tool_choice=gen.ToolChoice(
        mode=gen.TOOL_CHOICE_MODE_REQUIRED), parallel_tool_calls=False), ChatSettings())
    schema = json.loads(request.sampling.structured_output.json_schema)
    assert (schema["type"], schema["minItems"], schema["maxItems"]) == ("array", 1, 1)
    names = [one["properties"]["name"]["const"] for one in schema["items"]["anyOf"]]
    params = [one["properties"]["parameters"] for one in schema["items"]["anyOf"]]
    assert names == ["f", "g"] and params == [SCHEMA, {"type": "object", "properties": {}}]
    original = chat_request()
    request, make = planned(original, ChatSettings("hermes", True))  # auto: parsed only
    assert request is original and make is not None
    request, make = planned(chat_request(tool_choice=gen.ToolChoice(
        mode=gen.TOOL_CHOICE_MODE_NONE)), ChatSettings("hermes", True))
    assert make is None


@pytest.mark.parametrize("request_kw, settings, says", [
    ({}, ChatSettings(), "--enable-auto-tool-choice"),  # tools: "auto" by default
    ({"tools": [], "tool_choice": gen.ToolChoice(mode=gen.TOOL_CHOICE_MODE_REQUIRED)},
     ChatSettings(), "no tools"),
    ({"tool_choice": gen.ToolChoice(function="h")}, ChatSettings(), "no tool is named"),
    ({"tool_choice": gen.ToolChoice(function="f"),
      "sampling": gen.SamplingParams(structured_output=gen.StructuredOutput(regex="a"))},
     ChatSettings(), "drop the structured output"),
])
def test_a_tool_choice_that_cannot_be_served_is_refused(request_kw, settings, says):
    with pytest.raises(InvalidArgument, match=says) as e:
        planned(chat_request(**request_kw), settings)
    assert str(e.value).startswith("tool_choice:")


def test_with_a_reasoning_parser_a_constraint_starts_after_the_end_marker():
    regex = gen.SamplingParams(structured_output=gen.StructuredOutput(regex="a"))
    thinking = ChatSettings(reasoning_parser="qwen3")
    request, make = planned(chat_request(tools=[], sampling=regex), thinking)
    assert list(request.sampling.structured_output.start_after_token_ids) == END
    assert structured_of(request.sampling.structured_output).start_after == tuple(END)
    request, _ = planned(chat_request(tool_choice=gen.ToolChoice(function="f")), thinking)
    assert list(request.sampling.structured_output.start_after_token_ids) == END
    # A prompt that closed the thinking itself (enable_thinking false): from the start,
    # and nothing to split.
    request, make = planned(chat_request(tools=[], sampling=regex), thinking,
                            prompt=[1, 2, *END, 11])
    assert not request.sampling.structured_output.start_after_token_ids and make is None


def test_required_streams_each_call_as_its_items_arguments():
    items = [{"name": "f", "parameters": {"x": 1, "s": 'a"}, {'}},
             {"name": "g", "parameters": {}}, {"parameters": [1, {"y": 2}], "name": "f"}]
    for text in (json.dumps(items), json.dumps(items, separators=(",", ":"))):
        rng = random.Random(0)
        for _ in range(20):
            parser, calls, i = RequiredCalls(), {}, 0
            while i < len(text):
                k = rng.randint(1, 6)
                content, deltas = parser.feed(text[i:i + k])
                assert content == ""
                i += k
                for d in deltas:
                    if d.id is not None:
                        calls[d.index] = [d.name, d.arguments]
                    else:
                        calls[d.index][1] += d.arguments
            assert [(n, json.loads(a)) for n, a in calls.values()] == [
                (o["name"], o["parameters"]) for o in items]
            assert all(a == a.strip() for _, a in calls.values())


def test_the_wire_bounds_tools_and_tool_calls_before_the_parse():
    check = check_generate(Limits())
    many = gen.GenerateRequest(chat=gen.ChatMessages(
        messages=[gen.ChatMessage(role="user")], tools=[gen.Tool(name="t")] * (MAX_TOOLS + 1)))
    with pytest.raises(ValueError, match="chat.tools"):
        check(many.SerializeToString())
    calls = gen.ChatMessage(role="assistant", tool_calls=[gen.ToolCall(name="t")] * 3000)
    with pytest.raises(ValueError, match="tool calls"):
        check(gen.GenerateRequest(chat=gen.ChatMessages(messages=[calls])).SerializeToString())
    # A chat of many messages, each with its fields, is within the walk's budget.
    fine = gen.GenerateRequest(chat=gen.ChatMessages(messages=[gen.ChatMessage(
        role="assistant", content="c", name="n", reasoning_content="r",
        tool_calls=[gen.ToolCall(id="i", name="t", arguments="{}")])] * 2000))
    check(fine.SerializeToString())
    assert isinstance(check_chat(fine.chat, 10**7, Limits()), Chat)


def test_the_python_client_sends_what_the_http_api_sends_and_joins_the_parsed_chat():
    from baton.router.openai.protocol import ChatRequest
    from baton_client import Completion, generate_request
    from baton_client.results import chunk_of

    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "reasoning_content": "hmm",
                 "tool_calls": [{"id": "c1", "type": "function",
                                 "function": {"name": "f", "arguments": '{"x": 1}'}}]},
                {"role": "tool", "tool_call_id": "c1", "name": "f", "content": "2"}]
    tools = [{"type": "function", "function": {"name": "f", "description": "d",
                                               "parameters": SCHEMA}}]
    kw = dict(tools=tools, tool_choice={"type": "function", "function": {"name": "f"}},
              parallel_tool_calls=False, chat_template_kwargs={"enable_thinking": False})
    ours = generate_request(messages=messages, **kw)
    (http,) = ChatRequest(model="m", messages=messages, **kw).requests(64)
    assert ours.chat == http.chat and ours.tool_choice == http.tool_choice
    assert ours.parallel_tool_calls is False and http.parallel_tool_calls is False
    pieces = [gen.ChatDelta(reasoning_content="r"),
              gen.ChatDelta(content="a", tool_calls=[gen.ToolCallDelta(
                  index=0, id="call_1", name="f", arguments='{"x"')]),
              gen.ChatDelta(tool_calls=[gen.ToolCallDelta(index=0, arguments=": 1}")])]
    replies = [gen.GenerateResponse(chat=c, delta=gen.TokenDelta(text="t")) for c in pieces]
    replies[-1].delta.finish_reason = gen.FINISH_REASON_TOOL_CALLS
    done = Completion.of(chunk_of(r) for r in replies)
    assert (done.content, done.reasoning_content, done.finish_reason) == ("a", "r",
                                                                          "tool_calls")
    assert [(c.id, c.name, c.arguments) for c in done.tool_calls] == [
        ("call_1", "f", '{"x": 1}')]
    assert Completion.of([chunk_of(gen.GenerateResponse())]).content is None  # not parsed

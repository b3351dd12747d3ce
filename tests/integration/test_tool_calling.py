"""Tool calling and reasoning through the router's one path, with the official `openai`
client on the HTTP app and the gRPC path (Router.generate, what Generate streams), on a
colocated engine in this process (chat_models.py): the tiny Qwen3 whose greedy answer is
"<think>Let</think>Hello", on Qwen3's own tokenizer and chat template.

A named tool_choice and "required" are constraints, so whatever the random model writes,
the arguments parse and validate; streamed fragments join to the whole response's
arguments; a tool result turn (after an assistant's reasoning and call) renders as
transformers renders it with Qwen3's template; with --reasoning-parser qwen3 the reasoning
and the answer come apart (and a constraint starts after the reasoning); enable_thinking
false changes the prompt as it changes transformers'."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from baton.router.openai.protocol import ChatRequest
from baton.router.reply import Caller
from baton.v1 import generation_pb2 as gen
from tests.chat_models import ANSWER, REASONING, Server, qwen3_tokenizer, reasoner

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather",
                                           "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
PARSERS = {"tool_call_parser": "hermes", "enable_auto_tool_choice": True}


@pytest.fixture(scope="module")
def server():
    """"plain": no reasoning parser; "think": --reasoning-parser qwen3; "bare": neither
    parser."""
    folder = reasoner()
    s = Server(folder, {"plain": PARSERS, "think": {**PARSERS, "reasoning_parser": "qwen3"},
                        "bare": {}})
    s.folder = folder
    yield s
    s.close()


@pytest.fixture(scope="module")
def hf():
    """transformers' tokenizer of Qwen3, its own template: the reference of the rendered
    prompts."""
    return qwen3_tokenizer()


@pytest.fixture(autouse=True)
def nothing_left(server):
    yield
    assert server.idle(), "a request or a block outlived its test"


def ask(server, router: str, stream: bool = False, **kw):
    """One chat completion (greedy); streamed: its chunks."""
    async def main():
        client = server.client(router)
        kw.setdefault("messages", ASK)
        kw.setdefault("max_tokens", 48)
        out = await client.chat.completions.create(model="chat-reasoner", temperature=0,
                                                   stream=stream, **kw)
        return [c async for c in out] if stream else out

    return server.run(main())


def joined(chunks) -> dict:
    """A stream's chunks put together: role, reasoning, content, calls, finish reason."""
    out = {"reasoning": "", "content": "", "calls": {}, "finish": None}
    for c in chunks:
        choice = c.choices[0]
        d = choice.delta
        out["reasoning"] += (d.model_extra or {}).get("reasoning_content") or ""
        out["content"] += d.content or ""
        for t in d.tool_calls or []:
            if t.index not in out["calls"]:  # the first piece: its id, type and name
                assert t.id and t.type == "function" and t.function.name, t
                out["calls"][t.index] = [t.id, t.function.name, ""]
            else:
                assert not t.id and not t.function.name, t
            out["calls"][t.index][2] += t.function.arguments or ""
        out["finish"] = choice.finish_reason or out["finish"]
    return out


def calls_of(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


@pytest.mark.parametrize("router", ["plain", "think"])
def test_a_named_function_is_called_with_arguments_that_validate(server, router):
    whole = ask(server, router, tools=TOOLS, tool_choice=NAMED)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [(name, arguments)] = calls_of(choice.message)
    assert name == "get_weather" and choice.message.tool_calls[0].id.startswith("call_")
    jsonschema.validate(json.loads(arguments), WEATHER)
    streamed = joined(ask(server, router, stream=True, tools=TOOLS, tool_choice=NAMED))
    assert [(n, a) for _, n, a in streamed["calls"].values()] == [(name, arguments)]
    assert streamed["finish"] == "tool_calls" and streamed["content"] == ""
    # With the reasoning parser the constraint starts after "</think>": the thinking
    # comes first, as the model writes it, and apart.
    want = REASONING if router == "think" else None
    assert (choice.message.model_extra or {}).get("reasoning_content") == want
    assert streamed["reasoning"] == (want or "")


@pytest.mark.parametrize("parallel", [False, True])
def test_required_gives_calls_of_the_tools_that_validate(server, parallel):
    kw = dict(tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel,
              max_tokens=64)
    choice = ask(server, "plain", **kw).choices[0]
    calls = calls_of(choice.message)
    if not parallel:
        assert len(calls) == 1 and choice.finish_reason == "tool_calls"
    ended = calls if choice.finish_reason == "tool_calls" else calls[:-1]  # one cut short
    assert calls and ended
    for name, arguments in ended:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    streamed = joined(ask(server, "plain", stream=True, **kw))
    assert [(n, a) for _, n, a in streamed["calls"].values()] == calls
    assert streamed["finish"] == choice.finish_reason


def test_a_tool_result_turn_renders_through_the_template(server, hf):
    """The rendered prompt of a conversation with an assistant's reasoning and call and
    the tool's answer is transformers' apply_chat_template(messages, tools=...,
    enable_thinking=...) of it, with Qwen3's own template."""
    args = json.dumps({"city": "Paris", "unit": "c"})
    messages = [
        {"role": "system", "content": "Be brief."},
        *ASK,
        {"role": "assistant", "content": "", "reasoning_content": "Paris: ask the tool.",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": args}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"},
    ]
    router = server.routers["plain"]
    info = router.model_info()
    wants = []
    for kw in ({}, {"enable_thinking": False}):
        want = prompt_of(hf, messages, TOOLS, **kw)
        wants.append(want)
        text = hf.decode(want)
        assert "18 C and sunny" in text and '"city": "Paris"' in text
        # Qwen3's template: the tools in the system turn, the reasoning of a turn after
        # the last question, the tool's answer as the user's.
        assert '"name": "get_weather", "description": "The weather in a city"' in text
        assert "<think>\nParis: ask the tool.\n</think>\n\n<tool_call>" in text
        assert "<|im_start|>user\n<tool_response>\n18 C and sunny" in text
        (request,) = ChatRequest(model="m", messages=messages, tools=TOOLS,
                                 chat_template_kwargs=kw).requests(4096)
        assert server.run(router.intake.prompt_ids(request, info)) == want
    out = ask(server, "plain", messages=messages, tools=TOOLS, tool_choice="none")
    assert out.usage.prompt_tokens == len(wants[0]) and wants[0] != wants[1]
    assert out.choices[0].message.content == f"<think>{REASONING}</think>{ANSWER}"


def prompt_of(hf, messages, tools=None, **kw) -> list[int]:
    """transformers' rendering of a chat's prompt, as token ids."""
    return list(hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                       tokenize=True, return_dict=False, **kw))


def test_reasoning_and_content_come_apart_streamed_and_whole(server):
    whole = ask(server, "think").choices[0]
    assert whole.message.content == ANSWER and whole.finish_reason == "stop"
    assert whole.message.model_extra["reasoning_content"] == REASONING
    streamed = joined(ask(server, "think", stream=True))
    assert (streamed["reasoning"], streamed["content"]) == (REASONING, ANSWER)
    # Without the parser the text is the content, as the model wrote it.
    plain = ask(server, "plain").choices[0].message
    assert plain.content == f"<think>{REASONING}</think>{ANSWER}"
    assert "reasoning_content" not in (plain.model_extra or {})


def test_enable_thinking_false_changes_the_prompt_and_the_answer(server, hf):
    router = server.routers["think"]
    info = router.model_info()
    off = {"enable_thinking": False}
    prompts = []
    for kw in ({}, {"chat_template_kwargs": off}):
        (request,) = ChatRequest(model="m", messages=ASK, **kw).requests(4096)
        prompts.append(server.run(router.intake.prompt_ids(request, info)))
    assert prompts[1] == list(hf.apply_chat_template(
        ASK, add_generation_prompt=True, tokenize=True, return_dict=False, **off))
    assert prompts[0] == prompt_of(hf, ASK)
    assert hf.decode(prompts[1][len(prompts[0]):]) == "<think>\n\n</think>\n\n"
    assert prompts[1][:len(prompts[0])] == prompts[0] and len(prompts[1]) > len(prompts[0])
    out = ask(server, "think", extra_body={"chat_template_kwargs": off})
    message = out.choices[0].message
    assert message.content == ANSWER  # the model skips the thinking: all answer
    assert "reasoning_content" not in (message.model_extra or {})
    assert out.usage.prompt_tokens == len(prompts[1])


@pytest.mark.parametrize("router", ["plain", "think"])
def test_structured_output_applies_to_the_answer_after_the_reasoning(server, router):
    out = ask(server, router, extra_body={"guided_choice": ["yes", "no"]}).choices[0]
    assert out.message.content in ("yes", "no") and out.finish_reason == "stop"
    assert (out.message.model_extra or {}).get("reasoning_content") == (
        REASONING if router == "think" else None)


def test_the_grpc_stream_carries_the_parsed_chat(server):
    """Generate's responses: `chat` deltas (reasoning, content, tool call pieces) beside
    the raw text, and FINISH_REASON_TOOL_CALLS."""
    router = server.routers["think"]
    chat = gen.ChatMessages(messages=[gen.ChatMessage(role="user", content="Weather?")],
                            tools=[gen.Tool(name="get_weather", parameters=json.dumps(WEATHER))])
    request = gen.GenerateRequest(chat=chat, tool_choice=gen.ToolChoice(function="get_weather"),
                                  sampling=gen.SamplingParams(max_tokens=48, temperature=0))

    async def main():
        return [r async for r in router.generate(request, Caller())]

    replies = server.run(main())
    assert all(r.HasField("chat") for r in replies)
    assert replies[-1].delta.finish_reason == gen.FINISH_REASON_TOOL_CALLS
    assert "".join(r.chat.reasoning_content for r in replies) == REASONING
    pieces = [t for r in replies for t in r.chat.tool_calls]
    assert pieces[0].id.startswith("call_") and pieces[0].name == "get_weather"
    assert all(not p.id and not p.name for p in pieces[1:])
    text = "".join(r.delta.text for r in replies)
    arguments = "".join(p.arguments for p in pieces)
    assert text == f"<think>{REASONING}</think>{arguments}"
    jsonschema.validate(json.loads(arguments), WEATHER)


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a+"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].name"),
    ({"tools": TOOLS * 2}, "tools[2].name"),  # a name twice
    ({"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"x": "y" * 20000}}, "chat_template_kwargs"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"messages": [{"role": "user", "content": "hi", "mood": "happy"}]}, "messages[0].mood"),
])
def test_a_bad_tool_field_or_an_unknown_field_is_a_400_naming_it(server, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        ask(server, "plain", extra_body=body)
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body


def test_harmless_fields_and_nulls_pass(server):
    out = ask(server, "plain", metadata={"team": "a"}, store=False, service_tier="auto",
              user="u1", extra_body={"frobnicate": None},
              messages=[{"role": "user", "content": "hi", "refusal": None}])
    assert out.choices[0].message.content
    # The README's turn: the reply's own message object (its null fields and its
    # reasoning_content too), then the tool's answer.
    reply = ask(server, "think", tools=TOOLS, tool_choice=NAMED).choices[0].message
    call = reply.tool_calls[0]
    messages = [*ASK, reply, {"role": "tool", "tool_call_id": call.id, "content": "18 C"}]
    again = ask(server, "think", messages=messages, tools=TOOLS, tool_choice="none")
    assert again.choices[0].message.content == ANSWER


def test_auto_needs_the_routers_flags(server):
    with pytest.raises(openai.BadRequestError, match="enable-auto-tool-choice"):
        ask(server, "bare", tools=TOOLS)  # tool_choice "auto", OpenAI's default
    out = ask(server, "bare", tools=TOOLS, tool_choice="none").choices[0]
    assert out.message.content and not out.message.tool_calls

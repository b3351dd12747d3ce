"""Tool calling and reasoning through the services, colocated and disaggregated, with the
official `openai` client and gRPC Generate: the tiny Qwen3 of tests/chat_models.py
(Qwen3's tokenizer and template; greedy answer "<think>Let</think>Hello") behind routers
started with --reasoning-parser qwen3, --tool-call-parser hermes,
--enable-auto-tool-choice and a --chat-template file. A named function's arguments
validate and stream in fragments that join to them, after the reasoning, the same on both
topologies; the prompt is the flag's template's, not the model's own."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from baton.v1 import generation_pb2 as gen
from baton_client import Client, generate_request
from tests.chat_models import ANSWER, REASONING, TEMPLATE, reasoner
from tests.e2e.helpers import all_free_within, until_served
from tests.e2e.topology import Topology
from tests.integration.test_tool_calling import ASK, NAMED, TOOLS, WEATHER, joined

FLAGGED = "{{- '<|im_start|>system\\nFrom the flag.<|im_end|>\\n' -}}\n" + TEMPLATE


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    folder = reasoner()
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(FLAGGED)
    flags = ("--reasoning-parser", "qwen3", "--tool-call-parser", "hermes",
             "--enable-auto-tool-choice", "--chat-template", str(template))
    topo = Topology(tmp_path_factory.mktemp("tools"), folder)
    try:
        prefill = topo.worker("prefill", "--kv-transport", "grpc", wait=False)
        decode = topo.worker("decode", "--kv-transport", "grpc", wait=False)
        colocated = topo.worker("colocated", *flags, wait=False)
        router = topo.start("router", "--prefill", prefill, "--decode", decode, *flags)
        yield {"colocated": colocated, "router": router, "prefill": prefill,
               "decode": decode, "topology": topo, "folder": folder}
    finally:
        topo.stop()


def client(services, where: str) -> openai.OpenAI:
    http = services["topology"].http[services[where]]
    return openai.OpenAI(base_url=f"http://{http}/v1", api_key="none", max_retries=0)


def test_named_tool_calls_and_reasoning_colocated_and_disaggregated(services):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(services["folder"])
    flagged = hf.apply_chat_template(ASK, chat_template=FLAGGED, add_generation_prompt=True,
                                     tokenize=True, return_dict=False)
    assert len(flagged) != len(hf.apply_chat_template(ASK, add_generation_prompt=True,
                                                      tokenize=True, return_dict=False))
    seen = []
    for where in ("colocated", "router"):
        c = client(services, where)
        kw = dict(model="chat-reasoner", messages=ASK, temperature=0, max_tokens=48)
        plain = c.chat.completions.create(**kw)
        assert plain.choices[0].message.content == ANSWER
        assert plain.choices[0].message.model_extra["reasoning_content"] == REASONING
        assert plain.usage.prompt_tokens == len(flagged)  # --chat-template's prompt
        whole = c.chat.completions.create(tools=TOOLS, tool_choice=NAMED, **kw).choices[0]
        assert whole.finish_reason == "tool_calls"
        assert whole.message.model_extra["reasoning_content"] == REASONING
        [call] = whole.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
        streamed = joined(c.chat.completions.create(tools=TOOLS, tool_choice=NAMED,
                                                    stream=True, **kw))
        assert [(n, a) for _, n, a in streamed["calls"].values()] == [
            ("get_weather", call.function.arguments)]
        assert (streamed["reasoning"], streamed["finish"]) == (REASONING, "tool_calls")
        seen.append(call.function.arguments)
    assert seen[0] == seen[1]  # greedy: the same call colocated and disaggregated
    assert all_free_within([services["prefill"], services["decode"]], 5.0)


def test_grpc_generate_streams_the_parsed_chat(services):
    """gRPC Generate through the Python client: the parsed chat on its chunks."""
    request = generate_request(messages=ASK, tools=TOOLS, tool_choice=NAMED, max_tokens=48,
                               temperature=0)
    replies = until_served(services["router"], request)
    assert replies[-1].delta.finish_reason == gen.FINISH_REASON_TOOL_CALLS
    with Client(services["router"]) as client:
        done = client.complete(messages=ASK, tools=TOOLS, tool_choice=NAMED, max_tokens=48,
                               temperature=0, timeout=60)
    assert (done.finish_reason, done.reasoning_content) == ("tool_calls", REASONING)
    [call] = done.tool_calls
    assert call.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    assert done.text == f"<think>{REASONING}</think>{call.arguments}"  # the raw text too

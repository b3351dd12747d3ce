"""tool_choice "auto" on the router: --tool-call-parser finds the calls in the text a
worker streams (here a scripted fake that writes what Qwen-style models write, a few
characters at a time), with the official `openai` client, whole and streamed alike; with
--reasoning-parser too, only the answer after the reasoning is parsed for calls."""

from __future__ import annotations

import json

import pytest

from baton.v1 import generation_pb2 as gen
from baton.worker.v1 import worker_pb2 as wk
from tests.chat_models import QWEN3_VOCAB, Server, qwen3_tokenizer_dir
from tests.integration.test_tool_calling import PARSERS, TOOLS, joined
from tests.router_fakes import FakeWorker

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}' \
    '\n</tool_call>'
SAY_AND_CALL = "Let me check.\n" + CALL
THINK_AND_CALL = ('<think>\nI could write <tool_call>\n{"name": "add", "arguments": '
                  '{"a": 1, "b": 2}}\n</tool_call> here.\n</think>\n\nSure.\n' + CALL)


class Scripted(FakeWorker):
    """A decode worker that writes `script`, three characters a reply."""

    script = ""

    async def Decode(self, request, context):
        pieces = [self.script[i:i + 3] for i in range(0, len(self.script), 3)]
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            yield wk.DecodeResponse(delta=gen.TokenDelta(
                token_ids=[7], text=piece,
                finish_reason=gen.FINISH_REASON_STOP if last else 0))

    async def GetStats(self, request, context):
        stats = await super().GetStats(request, context)
        stats.model_info.vocab_size = QWEN3_VOCAB  # the router's tokenizer's
        return stats


@pytest.fixture(scope="module")
def server():
    """The router on Qwen3's tokenizer and template (--tokenizer: no model is built, the
    worker is scripted)."""
    worker = Scripted("decode", "scripted")
    folder = qwen3_tokenizer_dir()
    kw = {**PARSERS, "tokenizer": str(folder)}
    s = Server(folder, {"plain": kw, "think": {**kw, "reasoning_parser": "qwen3"}},
               decode=worker)
    s.worker = worker
    yield s
    s.close()


def ask(server, router: str, script: str, stream: bool = False, **kw):
    server.worker.script = script

    async def main():
        client = server.client(router)
        out = await client.chat.completions.create(
            model="fake", messages=[{"role": "user", "content": "Weather in Paris?"}],
            tools=TOOLS, stream=stream, **kw)
        return [c async for c in out] if stream else out

    return server.run(main())


def whole_and_streamed(server, router: str, script: str, **kw):
    message = ask(server, router, script, **kw).choices[0]
    streamed = joined(ask(server, router, script, stream=True, **kw))
    calls = [(c.function.name, c.function.arguments) for c in message.message.tool_calls or []]
    assert [(n, a) for _, n, a in streamed["calls"].values()] == calls
    assert streamed["content"] == (message.message.content or "")
    assert streamed["reasoning"] == (message.message.model_extra or {}).get(
        "reasoning_content", "")
    assert streamed["finish"] == message.finish_reason
    return message, calls


def test_auto_finds_the_call_after_the_text(server):
    choice, calls = whole_and_streamed(server, "plain", SAY_AND_CALL)
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    assert [(n, json.loads(a)) for n, a in calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"})]


def test_only_the_answer_after_the_reasoning_is_parsed_for_calls(server):
    choice, calls = whole_and_streamed(server, "think", THINK_AND_CALL)
    assert choice.message.model_extra["reasoning_content"] == (
        'I could write <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n'
        '</tool_call> here.')
    assert choice.message.content == "Sure." and choice.finish_reason == "tool_calls"
    assert [n for n, _ in calls] == ["get_weather"]


@pytest.mark.parametrize("script, kw", [
    (SAY_AND_CALL, {"tool_choice": "none"}),  # not parsed at all
    ("It is sunny in Paris.", {}),  # nothing to find
])
def test_text_without_calls_is_content(server, script, kw):
    choice, calls = whole_and_streamed(server, "plain", script, **kw)
    assert choice.message.content == script and calls == []
    assert choice.finish_reason == "stop"

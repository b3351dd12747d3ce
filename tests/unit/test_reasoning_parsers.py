"""Reasoning parsers on output as DeepSeek-R1 and Qwen3 write it: the whole text splits
into the exact reasoning and answer; streamed in every cut, the deltas join to the same;
an output without reasoning is all answer, as written."""

from __future__ import annotations

import pytest

from baton.services.common.reasoning import REASONING_PARSERS
from baton.services.common.tool_parsers import TOOL_PARSERS
from tests.unit.stream_splits import splits

HAIKU = "Crimson leaves descend\nwhispering to the cold earth\nautumn's last breath fades"

SAMPLES = [
    # DeepSeek-R1 (template ends with "<think>\n"): the output starts inside the reasoning.
    ("deepseek_r1", "Okay, the user asks for 17 * 23. 17 * 20 = 340, 17 * 3 = 51, so 391.\n"
                    "</think>\n\n17 × 23 = **391**.",
     "Okay, the user asks for 17 * 23. 17 * 20 = 340, 17 * 3 = 51, so 391.",
     "17 × 23 = **391**."),
    # Older DeepSeek-R1 templates: the model writes <think> itself.
    ("deepseek_r1", "<think>\nHmm, a greeting. I should answer briefly.\n</think>\n\nHello! "
                    "How can I help?",
     "Hmm, a greeting. I should answer briefly.", "Hello! How can I help?"),
    # Cut off while thinking: everything is reasoning.
    ("deepseek_r1", "Let me list the primes below 20: 2, 3, 5, 7, 11, 13, ",
     "Let me list the primes below 20: 2, 3, 5, 7, 11, 13,", ""),
    # Qwen3 thinking: tags in the reasoning that are not its end ("</thinking>", "</thin").
    ("qwen3", "<think>\nThe user wants a haiku about autumn. Not <b>bold</b>, no </thinking> "
              "tags, no </thin... Count syllables: 5-7-5.\n</think>\n\n" + HAIKU,
     "The user wants a haiku about autumn. Not <b>bold</b>, no </thinking> tags, no "
     "</thin... Count syllables: 5-7-5.", HAIKU),
    # Qwen3 with enable_thinking false: the prompt closed an empty <think>; all answer.
    ("qwen3", HAIKU, None, HAIKU),
    ("qwen3", "  Indented answer that mentions <think> tags.\n",
     None, "  Indented answer that mentions <think> tags.\n"),
    # Qwen3 deciding not to think.
    ("qwen3", "<think>\n\n</think>\n\nHello!", None, "Hello!"),
    # Qwen3 thinking, then a tool call in the answer.
    ("qwen3", "<think>\nI need the weather tool for Paris.\n</think>\n\n<tool_call>\n"
              '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "I need the weather tool for Paris.",
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
    # Cut off inside the end marker: the part of a marker is reasoning text.
    ("qwen3", "<think>\nAlmost done </thi", "Almost done </thi", ""),
    ("qwen3", "<thi", None, "<thi"),
    ("deepseek_r1", "", None, ""),
]


def stream(name: str, pieces: list[str]) -> tuple[str, str]:
    parser = REASONING_PARSERS[name]()
    reasoning, content = [], []
    for piece in pieces:
        r, c = parser.feed(piece)
        reasoning.append(r)
        content.append(c)
    r, c = parser.finish()
    return "".join(reasoning) + r, "".join(content) + c


@pytest.mark.parametrize("name,text,reasoning,content", SAMPLES,
                         ids=[f"{s[0]}-{i}" for i, s in enumerate(SAMPLES)])
def test_whole_and_every_cut_give_the_same_reasoning_and_answer(name, text, reasoning,
                                                                 content):
    assert REASONING_PARSERS[name]().parse(text) == (reasoning, content)
    for pieces in splits(text):
        assert stream(name, pieces) == (reasoning or "", content), pieces


def test_reasoning_streams_before_its_end_and_the_answer_after():
    parser = REASONING_PARSERS["qwen3"]()
    assert parser.feed("<thi") == ("", "") and parser.in_reasoning
    assert parser.feed("nk>\nStep one") == ("Step one", "")
    assert parser.feed(".\n</th") == (".", "")  # the newline may be the template's
    assert parser.feed("ink>\n\nAns") == ("", "Ans") and not parser.in_reasoning
    assert parser.feed("wer.") == ("", "wer.")
    assert parser.finish() == ("", "")


def test_without_think_qwen3_streams_the_answer_at_once():
    parser = REASONING_PARSERS["qwen3"]()
    assert parser.feed("Hi") == ("", "Hi") and not parser.in_reasoning


def test_markers_and_where_each_format_starts():
    r1, qwen3 = REASONING_PARSERS["deepseek_r1"], REASONING_PARSERS["qwen3"]
    assert r1.end_marker == qwen3.end_marker == "</think>"
    assert r1.starts_in_reasoning and not qwen3.starts_in_reasoning
    assert r1().parse("Hello") == ("Hello", "")  # no </think>: all of it was reasoning
    assert qwen3().parse("Hello") == (None, "Hello")


def test_the_answer_feeds_a_tool_parser():
    # The router chains them: reasoning parser first, the tool parser on its content.
    reasoning_parser = REASONING_PARSERS["qwen3"]()
    tools = TOOL_PARSERS["hermes"]([])
    text = SAMPLES[7][1]
    reasoning, content, args = "", "", ""
    for i in range(0, len(text), 5):
        r, c = reasoning_parser.feed(text[i:i + 5])
        reasoning += r
        out, deltas = tools.feed(c)
        content += out
        args += "".join(d.arguments for d in deltas)
    r, c = reasoning_parser.finish()
    out, deltas = tools.feed(c)
    out2, more = tools.finish()
    assert reasoning + r == "I need the weather tool for Paris."
    assert content + out + out2 == ""
    assert args + "".join(d.arguments for d in deltas + more) == '{"city":"Paris"}'

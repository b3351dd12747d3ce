"""A structured-output constraint that starts after a marker (a reasoning model's
"</think>"): the output up to and including the marker's tokens is free, the rest
follows the constraint; the same on a resumed request (a decode worker, a migration) and
across speculative drafts; and on the wire. On the tiny Qwen3 of chat_models.py, whose
greedy output is known: "<think>Let</think>Hello"."""

from __future__ import annotations

import pytest
import torch

from baton.services.common.sampling_params import SamplingParams, StructuredOutput
from baton.services.rpc.convert import sampling_message, sampling_params
from baton.v1 import generation_pb2 as gen
from tests.chat_models import reasoner
from tests.integration.engine_helpers import assert_idle

YES_NO = ("yes", "no")


@pytest.fixture(scope="module")
def llm(make_llm):
    return make_llm(model=str(reasoner()), dtype="float32",
                    max_num_batched_tokens=128)


def ids(llm, text: str) -> list[int]:
    return llm.engine.tokenizer.encode(text, add_special_tokens=False)


def prompt(llm) -> list[int]:
    return llm.engine.apply_chat_template([{"role": "user", "content": "Yes or no?"}])


def choice(after: list[int] = ()) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=12, structured=StructuredOutput(
        "choice", choices=YES_NO, start_after=tuple(after)))


def test_the_constraint_starts_after_the_marker_and_not_before(llm):
    free = llm.generate(prompt(llm), SamplingParams(temperature=0, max_tokens=12))[0]
    assert free.text == "<think>Let</think>Hello" and free.finish_reason == "stop"
    end = ids(llm, "</think>")
    after, at_once, never = llm.generate(
        [prompt(llm)] * 3, [choice(end), choice(), choice(ids(llm, "<tool_call>"))])
    head = ids(llm, "<think>Let</think>")
    # The reasoning as the model writes it, then one of the choices.
    assert after.token_ids[:len(head)] == head and after.finish_reason == "stop"
    assert after.text.removeprefix("<think>Let</think>") in YES_NO, after.text
    assert at_once.text in YES_NO  # without a marker: from the first token
    assert never.text == free.text  # a marker that never comes: never constrained
    assert_idle(llm)


def test_a_resumed_request_finds_where_the_constraint_started(llm, make_llm):
    """A decode worker continues from tokens sampled elsewhere: the marker among them
    starts the constraint; a token it forbids after the marker is refused, one before
    the marker is not."""
    end = ids(llm, "</think>")
    ref = llm.generate(prompt(llm), choice(end))[0]
    head = ids(llm, "<think>Let</think>")
    engine = llm.engine
    grammar = engine.grammars.compile(choice(end).structured)
    rid = engine.resume_request(prompt(llm), head, choice(end), grammar=grammar)
    outs = []
    while engine.has_unfinished_requests():
        outs += [t for o in engine.step() if o.request_id == rid for t in o.new_token_ids]
    assert head + outs == ref.token_ids
    with pytest.raises(ValueError, match="does not fit the structured output"):
        engine.resume_request(prompt(llm), head + ids(llm, "Hello"), choice(end),
                              grammar=grammar)
    rid = engine.resume_request(prompt(llm), ids(llm, "<think>Hello"), choice(end),
                                grammar=grammar)
    engine.abort_request(rid)
    assert_idle(llm)


def test_drafts_across_the_marker(llm):
    """Speculative drafts that cross the marker: free before it (all ones), the
    constraint's own mask after it; a draft the constraint forbids after the marker cuts
    them; the state is left as it was."""
    engine = llm.engine
    so = choice(ids(llm, "</think>")).structured
    state = engine.grammars.matcher(so, engine.grammars.compile(so))
    plain = engine.grammars.matcher(choice().structured)
    words = -(-engine.model_config.vocab_size // 32)
    drafts = ids(llm, "Let</think>") + ids(llm, "yes")
    assert state.valid_prefix(drafts + ids(llm, "Hello")) == drafts
    assert state.valid_prefix(ids(llm, "</think>Hello")) == ids(llm, "</think>")
    got = torch.zeros(len(drafts) + 1, words, dtype=torch.int32)
    state.fill(got, 0, drafts)
    want = torch.zeros(2, words, dtype=torch.int32)
    plain.fill(want, 0, [])  # the constraint's first mask
    plain.accept(drafts[2])
    plain.fill(want, 1, [])  # and after "yes"'s first token
    assert (got[:2] == -1).all()  # before the marker and after its first half: free
    assert torch.equal(got[2], want[0]) and torch.equal(got[3], want[1])
    assert not state.started and not state.terminated  # as it was
    assert state.accept(ids(llm, "Hello")[0])  # still free


def test_the_marker_crosses_the_wire():
    so = StructuredOutput("regex", "[a-z]+", start_after=(7, 8))
    msg = sampling_message(max_tokens=4, structured=so)
    assert list(msg.structured_output.start_after_token_ids) == [7, 8]
    assert sampling_params(gen.SamplingParams.FromString(msg.SerializeToString())
                           ).structured == so
    assert so.key == StructuredOutput("regex", "[a-z]+").key  # one compiled grammar
    with pytest.raises(ValueError, match="start_after"):
        StructuredOutput("regex", "a", start_after=tuple(range(17)))
    with pytest.raises(ValueError, match="start_after"):
        sampling_params(gen.SamplingParams(structured_output=gen.StructuredOutput(
            regex="a", start_after_token_ids=[-1])))

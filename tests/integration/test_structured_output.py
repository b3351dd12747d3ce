"""Structured output in the engine: JSON that parses and validates against its schema
(checked by `jsonschema`), regexes that full-match, exact choices, grammars; the same
tokens with speculation, under preemption and when a decode engine resumes the request;
bad constraints refused before anything is queued; a dead end ends the request. On the
tiny serving model, but for a JSON object's end, which only a real model reaches."""

from __future__ import annotations

import json
import math
import re

import jsonschema
import pytest

from baton.router.openai.render import Choice, Renderer, event
from baton.services.common.sampling_params import StructuredOutput
from baton.services.engine import SamplingParams
from baton.services.engine.config import SpecConfig
from baton.services.rpc.convert import logprobs_messages
from baton.v1 import generation_pb2 as gen
from tests.integration.engine_helpers import assert_idle, greedy, kv_gib

SCHEMAS = [
    ("a person", {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"]}),
    ("a user account", {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 999999},
            "email": {"type": "string", "maxLength": 30}}, "required": ["id", "email"]},
        "active": {"type": "boolean"}}, "required": ["user", "active"]}),
    ("the colours of a flag", {"type": "object", "properties": {
        "colors": {"type": "array", "items": {"enum": ["red", "green", "blue", "white"]},
                   "minItems": 1, "maxItems": 3}}, "required": ["colors"]}),
    ("a weather reading", {"type": "object", "properties": {
        "temperature": {"type": "number", "minimum": -50, "maximum": 50},
        "count": {"type": "integer", "exclusiveMinimum": 0, "maximum": 10}},
        "required": ["temperature", "count"]}),
    ("a status report", {"type": "object", "properties": {
        "status": {"enum": ["ok", "error"]},
        "code": {"type": "integer", "minimum": 100, "maximum": 599},
        "message": {"type": "string", "maxLength": 40}}, "required": ["status", "code"]}),
    ("a shopping list", {"type": "object", "properties": {
        "items": {"type": "array", "maxItems": 2, "items": {
            "type": "object", "properties": {
                "name": {"type": "string", "maxLength": 12},
                "price": {"type": "number", "minimum": 0, "maximum": 1000}},
            "required": ["name", "price"]}}}, "required": ["items"]}),
    ("a small matrix", {"type": "object", "properties": {
        "matrix": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
            "type": "array", "minItems": 1, "maxItems": 2,
            "items": {"type": "integer", "minimum": -9, "maximum": 9}}}},
        "required": ["matrix"]}),
    ("a book", {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 30},
        "year": {"type": "integer", "minimum": 1400, "maximum": 2030},
        "genre": {"type": "string", "enum": ["fiction", "history", "science"]},
        "available": {"type": "boolean"}},
        "required": ["title", "year", "genre", "available"], "additionalProperties": False}),
]
REGEXES = [r"\d{3}-\d{4}", r"(cat|dog|bird)s?", r"[A-Z][a-z]{2,8} [A-Z][a-z]{2,8}",
           r"[a-z]{3,8}@[a-z]{3,8}\.(com|org)", r"(19|20)\d{2}-(0[1-9]|1[0-2])"]
GBNF = 'root ::= num " " op " " num\nnum ::= [1-9] [0-9]?\nop ::= "+" | "-" | "*"'
LARK = 'start: "The answer is " NUM "."\nNUM: /[0-9]{1,3}/'


def constrained(so: StructuredOutput, max_tokens: int = 160, **kw) -> SamplingParams:
    kw.setdefault("temperature", 0)
    return SamplingParams(max_tokens=max_tokens, structured=so, **kw)


def ask(llm, text: str) -> list[int]:
    return llm.engine.apply_chat_template([{"role": "user", "content": text}])


@pytest.fixture(scope="module")
def llm(make_llm, tiny_model):
    # The tiny serving model: what is checked is the constraint, not the model's answer.
    # fp32: greedy (and seeded) outputs the same on any CPU.
    return make_llm(model=str(tiny_model), dtype="float32", max_num_batched_tokens=256,
                    max_num_seqs=16)


def test_json_schemas_parse_and_validate_greedy_and_sampled(llm):
    prompts, params = [], []
    for what, schema in SCHEMAS:
        so = StructuredOutput("json", json.dumps(schema))
        for kw in ({}, {"temperature": 0.9, "seed": 3}):
            prompts.append(ask(llm, f"Describe {what} as JSON."))
            params.append(constrained(so, **kw))
    # One batch: constrained rows of different schemas side by side.
    outs = llm.generate(prompts, params)
    for (what, schema), pair in zip(SCHEMAS, zip(outs[::2], outs[1::2], strict=True),
                                    strict=True):
        for out in pair:
            assert out.finish_reason == "stop", (what, out.text)
            jsonschema.validate(json.loads(out.text), schema)
    assert_idle(llm)


@pytest.mark.slow
def test_json_object_ends_as_one(make_llm):
    """On the real default model: a random model's string never closes, as any JSON
    object allows a string without end."""
    real = make_llm(dtype="float32", max_num_batched_tokens=256, kv_cache_gib=0.05)
    out = real.generate(ask(real, "Give me a JSON object about a cat."),
                        constrained(StructuredOutput("json_object"), 200))[0]
    assert out.finish_reason == "stop" and isinstance(json.loads(out.text), dict), out.text
    assert_idle(real)


def test_regex_choice_and_grammars(llm):
    cases = [(StructuredOutput("regex", r), f"Write something that matches {r}",
              lambda t, r=r: re.fullmatch(r, t) is not None) for r in REGEXES]
    for choices in (("Paris", "London", "Berlin"), ("positive", "negative", "neutral")):
        cases.append((StructuredOutput("choice", choices=choices),
                      "Pick one: " + ", ".join(choices),
                      lambda t, c=choices: t in c))
    cases.append((StructuredOutput("grammar", GBNF), "Write a sum.",
                  lambda t: re.fullmatch(r"[1-9][0-9]? [-+*] [1-9][0-9]?", t) is not None))
    cases.append((StructuredOutput("grammar", LARK), "What is 2 + 2?",
                  lambda t: re.fullmatch(r"The answer is [0-9]{1,3}\.", t) is not None))
    outs = llm.generate([ask(llm, q) for _, q, _ in cases],
                        [constrained(so, 64) for so, _, _ in cases])
    for (so, _, check), out in zip(cases, outs, strict=True):
        assert out.finish_reason == "stop" and check(out.text), (so, out.text)
    assert_idle(llm)


def test_unconstrained_rows_in_the_same_batch_are_untouched(llm):
    p = ask(llm, "Tell me about the moon.")
    alone = llm.generate([p], greedy(24))[0]
    so = StructuredOutput("regex", r"[a-z]{1,5}")
    mixed = llm.generate([p, p], [greedy(24), constrained(so, 24)])
    assert mixed[0].token_ids == alone.token_ids
    assert re.fullmatch(r"[a-z]{1,5}", mixed[1].text)


@pytest.mark.slow
def test_same_tokens_with_speculation_and_under_preemption(make_llm, tiny_model):
    kw = dict(model=str(tiny_model), dtype="float32", max_num_batched_tokens=64)
    plain = make_llm(**kw)
    spec = make_llm(speculative=SpecConfig(method="ngram"), **kw)
    tight = make_llm(kv_cache_gib=kv_gib(tiny_model, 13), max_model_len=160, **kw)
    # A book: the tiny model writes about 50 tokens of it, so 4 requests need more than
    # the 13 blocks, and its `", "` repeat for the drafts.
    what, schema = SCHEMAS[7]
    so = StructuredOutput("json", json.dumps(schema))
    ps = [ask(plain, f"Describe {what} as JSON."), ask(plain, "Make a shopping list.")]
    ps += [p[:60] for p in ps]
    ref = plain.generate(ps, constrained(so, 64))
    for other in (spec, tight):
        got = other.generate(ps, constrained(so, 64))
        assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert tight.engine.stats().num_preemptions > 0
    assert spec.engine.stats().num_spec_accepted_tokens > 0
    for x in (plain, spec, tight):
        assert_idle(x)


def test_a_resumed_request_rebuilds_its_matcher(llm, make_llm):
    """What a decode worker (or a migration) does: continue from tokens sampled
    elsewhere. The continuation equals the offline run; a token the constraint forbids
    is refused, with nothing queued."""
    what, schema = SCHEMAS[0]
    so = StructuredOutput("json", json.dumps(schema))
    p = ask(llm, f"Describe {what} as JSON.")
    ref = llm.generate([p], constrained(so, 64))[0]
    other = make_llm(model=llm.engine.config.model, dtype="float32",
                     max_num_batched_tokens=256)
    grammar = other.engine.grammars.compile(so)  # what a worker does before the admit
    rid = other.engine.resume_request(p, ref.token_ids[:5], constrained(so, 64),
                                      grammar=grammar)
    outs = []
    while other.engine.has_unfinished_requests():
        outs += [o for o in other.engine.step() if o.request_id == rid]
    assert ref.token_ids[:5] + [t for o in outs for t in o.new_token_ids] == ref.token_ids
    bad = llm.engine.tokenizer.encode("hello", add_special_tokens=False)
    with pytest.raises(ValueError, match="does not fit the structured output"):
        other.engine.resume_request(p, bad, constrained(so, 64))
    assert ref.token_ids[-1] in llm.engine.model_config.eos_token_ids
    with pytest.raises(ValueError, match="the structured output constraint is complete"):
        other.engine.resume_request(p, ref.token_ids, constrained(so, 200))
    assert_idle(other)


@pytest.mark.parametrize("so,problem", [
    (StructuredOutput("regex", "((("), "regex"),
    (StructuredOutput("grammar", "root ::= "), "grammar"),
    (StructuredOutput("json", '{"type": "bogus"}'), "json"),
])
def test_a_constraint_that_cannot_compile_is_refused_before_queueing(llm, so, problem):
    with pytest.raises(ValueError, match=f"structured output {problem}: cannot compile"):
        llm.generate([[1, 2, 3], [4, 5]], [greedy(4), constrained(so)])
    assert not llm.engine.has_unfinished_requests()
    # The engine itself never compiles: uncompiled, it refuses.
    with pytest.raises(ValueError, match=f"structured output {problem}: not compiled"):
        llm.engine.add_request([1, 2, 3], constrained(so))


def test_a_dead_end_ends_the_request_with_its_own_finish_reason(llm, monkeypatch):
    """A matcher whose mask allows nothing (no real grammar here reaches one; the
    matcher is replaced) ends the request as "constraint", its blocks freed, and the
    other rows of the batch go on."""
    class DeadEnd:
        terminated = False

        def fill(self, bitmask, row, drafts):
            bitmask[row:row + len(drafts) + 1] = 0

        def accept(self, token):
            return True

        def valid_prefix(self, tokens):
            return []

    monkeypatch.setattr(llm.engine.grammars, "matcher", lambda so, compiled: DeadEnd())
    p = ask(llm, "Hello")
    outs = llm.generate([p, p], [constrained(StructuredOutput("json_object"), 16),
                                 greedy(8)])
    assert outs[0].finish_reason == "constraint" and outs[0].token_ids == []
    assert outs[1].finish_reason == "length" and len(outs[1].token_ids) == 8
    assert_idle(llm)


def test_the_mask_allows_exactly_what_xgrammars_own_kernel_allows():
    """BatchMask.apply against xgrammar's reference apply, on random bitmasks (a dead
    row included), for a subset of rows."""
    from concurrent.futures import Future

    import torch
    import xgrammar as xgr

    from baton.services.engine.structured_output import BatchMask

    vocab, rows = 1000, [0, 2, 3]
    mask = BatchMask(vocab)
    g = torch.Generator().manual_seed(0)
    mask._bitmask = torch.randint(-2**31, 2**31 - 1, (4, mask.words), dtype=torch.int32,
                                  generator=g)
    mask._bitmask[3] = 0  # dead
    logits = torch.randn(4, vocab, generator=g)
    want = logits.clone()
    xgr.apply_token_bitmask_inplace(want, mask._bitmask.clone(), indices=rows[:2])
    done = Future()
    done.set_result(rows)
    assert mask.apply(logits, done) == [3]
    assert torch.equal(logits[:3], want[:3])
    assert torch.isfinite(logits[3]).all()  # a dead row is left as it was


def test_a_drafted_stop_token_ends_the_drafts_it_can_verify(llm):
    """The proposer may draft the stop token (prompts hold it after every chat turn):
    the matcher is filled up to it, the row after it allows nothing, and its state is
    left as it was."""
    import torch

    engine = llm.engine
    yes_only = StructuredOutput("choice", choices=("yes",))
    state = engine.grammars.matcher(yes_only, engine.grammars.compile(yes_only))
    eos = engine.model_config.eos_token_ids[0]
    yes = engine.tokenizer.encode("yes", add_special_tokens=False)
    drafts = state.valid_prefix(yes + [eos, yes[0]])
    assert drafts == yes + [eos]
    bitmask = torch.full((len(drafts) + 1, -(-engine.model_config.vocab_size // 32)), -1,
                         dtype=torch.int32)
    state.fill(bitmask, 0, drafts)
    assert (bitmask[-1] == 0).all() and (bitmask[:-1] != 0).any(dim=1).all()
    assert state.accept(yes[0]) and not state.terminated  # back at the start


def _not_json(name: str):
    raise ValueError(f"{name} is not strict JSON")


def test_logprobs_wider_than_the_constraint_are_finite_and_strict_json(llm):
    """guided_choice ["yes", "no"] with top_logprobs 5: the tokens the constraint masks
    are left out of the top 5 (never -inf), so the gRPC message and both OpenAI shapes
    (whole and streamed) are strict JSON."""
    so = StructuredOutput("choice", choices=("yes", "no"))
    out = llm.generate(ask(llm, "Is the sky blue? Answer yes or no."),
                       constrained(so, 8, logprobs=5))[0]
    assert out.text in ("yes", "no") and out.logprobs
    for token, entries in zip(out.token_ids, out.logprobs, strict=True):
        assert token in entries and all(math.isfinite(v) for v in entries.values())
    assert len(out.logprobs[0]) < 6  # the first token: only "yes" or "no" can start it
    delta = gen.TokenDelta(token_ids=out.token_ids, text=out.text,
                           logprobs=logprobs_messages(out.logprobs),
                           finish_reason=gen.FINISH_REASON_STOP)
    reply = gen.GenerateResponse(request_id="r", delta=delta)
    renderer = Renderer(True, "m", lambda t: llm.engine.tokenizer.decode([t]))
    choice = Choice(0)
    choice.add(reply)
    body = json.loads(renderer.whole_json([choice], 1, 5), parse_constant=_not_json)
    top = body["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    assert 1 <= len(top) < 6 and all(math.isfinite(t["logprob"]) for t in top)
    assert "Infinity" not in event(renderer.chunk(0, reply, True, 5, False))
    assert_idle(llm)

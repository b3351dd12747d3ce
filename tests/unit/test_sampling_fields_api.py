"""min_tokens, logit_bias, bad_words and echo at the front door: bounded on the gRPC wire
bytes and in HTTP bodies before anything is built per item, checked by the router
(INVALID_ARGUMENT / 400 naming the field), and echo's prompt text in front of each choice,
whole and streamed, over the real router and OpenAI app (fake workers)."""

from __future__ import annotations

import json

import pytest

from baton.router import wire
from baton.router.openai import body as body_module
from baton.router.openai.body import parse_body
from baton.router.openai.protocol import ChatRequest, CompletionRequest
from baton.services.common.limits import (
    BOUNDS,
    Limits,
    OverLimit,
)
from baton.v1 import generation_pb2 as gen

MESSAGES = [{"role": "user", "content": "hi"}]
LOGIT_BIAS_CEILING = BOUNDS["logit_bias"].ceiling
BAD_WORDS_CEILING = BOUNDS["bad_words"].ceiling
BAD_WORD_CHARS_CEILING = BOUNDS["bad_word_chars"].ceiling


def _sampling(**kw) -> bytes:
    return gen.GenerateRequest(text="a", sampling=gen.SamplingParams(**kw)).SerializeToString()


def test_logit_bias_and_bad_words_are_counted_on_the_wire():
    check = wire.check_generate(Limits())
    most = {i: 1.0 for i in range(LOGIT_BIAS_CEILING)}
    check(_sampling(logit_bias=most, bad_words=["w"] * BAD_WORDS_CEILING))
    with pytest.raises(OverLimit, match="^sampling.logit_bias: more than the limit of 300"):
        check(_sampling(logit_bias={**most, LOGIT_BIAS_CEILING: 1.0}))
    with pytest.raises(OverLimit, match="^sampling.bad_words: more than the limit of 128"):
        check(_sampling(bad_words=["w"] * (BAD_WORDS_CEILING + 1)))
    check(_sampling(bad_words=["é" * BAD_WORD_CHARS_CEILING]))  # characters, not bytes
    with pytest.raises(OverLimit, match="^sampling.bad_words: 513, over the limit of 512"):
        check(_sampling(bad_words=["a" * (BAD_WORD_CHARS_CEILING + 1)]))


@pytest.mark.parametrize("body, says", [
    ({"logit_bias": {str(i): 1 for i in range(LOGIT_BIAS_CEILING + 1)}},
     "^logit_bias: 301, over the limit of 300 entries"),
    ({"bad_words": ["w"] * (BAD_WORDS_CEILING + 1)}, "^bad_words: .*the limit of 128 words"),
    ({"bad_words": ["a" * (BAD_WORD_CHARS_CEILING + 1)]}, "^bad_words: 513, over the limit"),
])
@pytest.mark.parametrize("counting", [False, True])
def test_logit_bias_and_bad_words_are_counted_before_the_model(body, says, counting,
                                                               monkeypatch):
    if counting:
        monkeypatch.setattr(body_module, "CHEAP", 0)
    raw = json.dumps({"model": "m", "messages": MESSAGES, **body}).encode()
    with pytest.raises(OverLimit, match=says):
        parse_body(raw, ChatRequest, Limits())




def test_completions_bodies_take_the_fields_too():
    (req,) = CompletionRequest(model="m", prompt="p", min_tokens=2, bad_words=["a b"],
                               logit_bias={"3": -2}).requests(2048)
    assert (req.sampling.min_tokens, list(req.sampling.bad_words),
            dict(req.sampling.logit_bias)) == (2, ["a b"], {3: -2.0})

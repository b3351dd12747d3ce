"""Non-finite sampling values are refused by name (NaN slips through `x < 0` checks, and
one NaN row would poison a whole batch's sampling step)."""

from __future__ import annotations

import math
import re

import pytest

from baton.services.engine import SamplingParams


@pytest.mark.parametrize("name", ["temperature", "top_p", "min_p", "repetition_penalty",
                                  "presence_penalty", "frequency_penalty"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_values_are_refused(name, value):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})


@pytest.mark.parametrize("kw, words", [
    ({"min_tokens": 17}, "min_tokens (17) must be at most max_tokens (16)"),
    ({"min_tokens": -1}, "min_tokens must be an integer >= 0"),
    ({"logit_bias": {5: 100.5}}, "logit_bias of token 5 must be a number in [-100, 100]"),
    ({"logit_bias": {5: math.nan}}, "logit_bias of token 5"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias keys must be token ids"),
    ({"logit_bias": [(3, 1.0), (3, 2.0)]}, "logit_bias gives token 3 more than one bias"),
    ({"logit_bias": {i: 1.0 for i in range(301)}}, "logit_bias may hold at most 300"),
    ({"bad_words": ["ok", "  "]}, "bad_words must be non-blank strings"),
    ({"bad_words": ["w"] * 129}, "bad_words may hold at most 128 words"),
    ({"bad_words": ["w" * 513]}, "bad_words may hold at most 512 characters a word"),
])
def test_bad_min_tokens_logit_bias_and_bad_words_are_refused_by_name(kw, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        SamplingParams(**kw)


def test_min_tokens_logit_bias_and_bad_words_are_stored_plainly():
    p = SamplingParams(max_tokens=5, min_tokens=5, logit_bias={9: -100, 2: 0.5},
                       bad_words="no")
    assert (p.min_tokens, p.logit_bias, p.bad_words) == (5, ((2, 0.5), (9, -100.0)), ("no",))
    assert p == SamplingParams(max_tokens=5, min_tokens=5, logit_bias=[(9, -100), (2, 0.5)],
                               bad_words=["no"])
    hash(p)

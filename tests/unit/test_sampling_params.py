"""Non-finite sampling values are refused by name (NaN slips through `x < 0` checks, and
one NaN row would poison a whole batch's sampling step)."""

from __future__ import annotations

import math

import pytest

from baton.services.engine import SamplingParams


@pytest.mark.parametrize("name", ["temperature", "top_p", "min_p", "repetition_penalty",
                                  "presence_penalty", "frequency_penalty"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_values_are_refused(name, value):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})

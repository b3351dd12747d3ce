"""Stop strings matched by one automaton: the same answers as a brute-force search (the
first stop to complete, at the same end the longer; the tail to hold back), and a cost
per new token (counted in lines run) that does not grow with the number of stop strings."""

from __future__ import annotations

import random
import sys

import pytest

from baton.services.common.tokenizer import load_tokenizer
from baton.services.engine.default_model import ensure_default_model
from baton.services.engine.detokenizer import IncrementalDetokenizer
from baton.services.engine.stop_matcher import StopMatcher


def brute_force(text: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """(end, stop) of the first stop to complete in `text`, the longer at the same end."""
    found = [(text.find(s) + len(s), -len(s), s) for s in stops if s in text]
    if not found:
        return None
    end, _, stop = min(found)
    return end, stop


def held(text: str, stops: tuple[str, ...]) -> int:
    return max((k for k in range(1, len(text) + 1) for s in stops
                if s.startswith(text[-k:])), default=0)


@pytest.mark.parametrize("seed", range(20))
def test_same_answers_as_brute_force_in_any_pieces(seed: int) -> None:
    rng = random.Random(seed)
    alphabet = "abc" if seed % 2 else "ab🎉"
    stops = tuple({"".join(rng.choices(alphabet, k=rng.randint(1, 5)))
                   for _ in range(rng.randint(1, 8))})
    text = "".join(rng.choices(alphabet, k=60))
    want = brute_force(text, stops)
    matcher, fed = StopMatcher(stops), ""
    while len(fed) < len(text):
        piece = text[len(fed):len(fed) + rng.randint(1, 7)]
        got = matcher.feed(piece)
        if got is not None:
            assert (len(fed) + got[0], got[1]) == want, (stops, text)
            return
        fed += piece
        assert matcher.held == held(fed, stops), (stops, fed)
    assert want is None, (stops, text)


def _stream_cost(tok, ids: list[int], stops: tuple[str, ...]) -> int:
    """The Python lines run to detokenize `ids` against `stops`: a count of the work
    done, the same on any machine under any load (a time would be neither)."""
    detok = IncrementalDetokenizer(tok, [], stop=stops)  # built outside the count
    lines = 0

    def trace(frame, event, arg):
        nonlocal lines
        lines += event == "line"
        return trace

    sys.settrace(trace)
    try:
        for i in ids:
            detok.update([i])
    finally:
        sys.settrace(None)
    assert detok.stop_matched is None
    return lines


def test_a_token_costs_the_same_with_one_stop_or_ten_thousand() -> None:
    tok = load_tokenizer(ensure_default_model())
    ids = tok.encode("The quick brown fox jumps over the lazy dog, again and again. " * 8)
    rng = random.Random(0)
    # Stops that share the text's characters (so partial matches happen) but never occur.
    many = tuple("".join(rng.choices("abcdefghijklmnopqrstuvwxyz ,.", k=8)) + "#"
                 for _ in range(10_000))
    one, lots = _stream_cost(tok, ids, ("#",)), _stream_cost(tok, ids, many)
    # Failure links add a little; scanning every stop per token would run thousands of
    # times more lines.
    assert one < lots < 2 * one, (one, lots)

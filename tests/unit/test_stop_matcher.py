"""Stop strings matched by one automaton: the same answers as a brute-force search (the
first stop to complete, at the same end the longer; the tail to hold back), and a cost
per new token that does not grow with the number of stop strings."""

from __future__ import annotations

import random
import time

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


def _stream_time(tok, ids: list[int], stops: tuple[str, ...]) -> float:
    detok = IncrementalDetokenizer(tok, [], stop=stops)  # built outside the timing
    t0 = time.perf_counter()
    for i in ids:
        detok.update([i])
    assert detok.stop_matched is None
    return time.perf_counter() - t0


def test_a_token_costs_the_same_with_one_stop_or_ten_thousand() -> None:
    tok = load_tokenizer(ensure_default_model())
    ids = tok.encode("The quick brown fox jumps over the lazy dog, again and again. " * 8)
    rng = random.Random(0)
    # Stops that share the text's characters (so partial matches happen) but never occur.
    many = tuple("".join(rng.choices("abcdefghijklmnopqrstuvwxyz ,.", k=8)) + "#"
                 for _ in range(10_000))
    one = min(_stream_time(tok, ids, ("#",)) for _ in range(3))
    lots = _stream_time(tok, ids, many)
    # Scanning every stop per token costs thousands of times more here.
    assert lots < 10 * one + 0.05, (one, lots)

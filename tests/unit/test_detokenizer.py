"""IncrementalDetokenizer against tokenizer.decode of the whole output as the reference."""

from __future__ import annotations

import random

import pytest

from baton.services.common.tokenizer import load_tokenizer
from baton.services.engine.default_model import ensure_default_model
from baton.services.engine.detokenizer import IncrementalDetokenizer

PROMPT = "You are a helpful assistant. Say something:"
MULTIBYTE = [
    "Héllo wörld, ça va? Ñandú año",
    "Party 🎉🎉 time 👨‍👩‍👧 ok 🚀!",
    "世界你好，日本語のテキスト。한국어",
    "mixed: naïve café 😀 中文 résumé ∑∫√",
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ensure_default_model())


def stream(detok: IncrementalDetokenizer, ids: list[int], step: int = 1) -> list[str]:
    deltas = []
    for i in range(0, len(ids), step):
        deltas.append(detok.update(ids[i : i + step]))
        if detok.stop_matched is not None:
            return deltas
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("text", MULTIBYTE)
@pytest.mark.parametrize("prompt", ["", PROMPT])
def test_multibyte_one_token_at_a_time(tok, text: str, prompt: str) -> None:
    ids = tok.encode(text)
    # The text must really split characters over tokens, or this test proves nothing.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tok, tok.encode(prompt))
    deltas = [detok.update([i]) for i in ids]
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids) == detok.text
    assert detok.flush() == ""


@pytest.mark.parametrize("text", MULTIBYTE)
def test_leading_space_after_prompt(tok, text: str) -> None:
    ids = tok.encode(" " + text)
    detok = IncrementalDetokenizer(tok, tok.encode(PROMPT))
    assert "".join(stream(detok, ids)) == " " + text


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("seed", range(8))
def test_random_ids(tok, seed: int, skip: bool) -> None:
    rng = random.Random(seed)
    vocab = len(tok)
    specials = list(tok.all_special_ids)
    ids = [
        rng.choice(specials) if rng.random() < 0.1 else rng.randrange(vocab)
        for _ in range(rng.randrange(1, 120))
    ]
    prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 10))]
    expected = tok.decode(ids, skip_special_tokens=skip)
    for step in (1, 3, len(ids)):
        detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
        deltas = stream(detok, ids, step)
        assert "".join(deltas) == expected == detok.text, (seed, step)


def test_random_ids_split_characters(tok) -> None:
    # Sequences of byte tokens: characters split over tokens, invalid bytes, a tail that
    # never completes.
    byte_ids = [i for i in range(len(tok)) if len(tok.convert_ids_to_tokens(i)) == 1]
    rng = random.Random(1)
    for _ in range(50):
        ids = [rng.choice(byte_ids) for _ in range(rng.randrange(1, 30))]
        detok = IncrementalDetokenizer(tok, [])
        deltas = stream(detok, ids)
        assert "".join(deltas) == tok.decode(ids) == detok.text
        # Only flush() may end in a replacement char (an incomplete tail).
        assert not any(d.endswith("\ufffd") for d in deltas[:-1])



@pytest.mark.parametrize("stop, min_tokens", [((), 0), (("🎉 t", "naïve"), 0), (("é",), 4)])
def test_a_replay_in_one_update_goes_on_as_the_stream_would(tok, stop, min_tokens) -> None:
    # A migration (LLMEngine.resume_request): a new detokenizer is given every token
    # streamed so far in one update(), then goes on one token at a time. Cut anywhere (a
    # character split over tokens, a stop string's start held back), the text sent before
    # the cut and after it must be the stream's: nothing held back lost, nothing sent twice.
    ids = tok.encode(" ".join(MULTIBYTE))
    prompt = tok.encode(PROMPT)

    def detok():
        return IncrementalDetokenizer(tok, prompt, stop=stop, min_tokens=min_tokens)

    whole, sent = detok(), []
    for t in ids:
        sent.append(whole.update([t]))
        if whole.stop_matched is not None:
            break
    want = "".join(sent) + whole.flush()
    assert (whole.stop_matched is None) == (not stop), whole.stop_matched
    assert "" in sent[:-1], "no cut holds text back: this test would prove nothing"
    for cut in range(1, len(sent)):  # the stream had not ended there
        resumed = detok()
        resumed.update(ids[:cut])
        rest = stream(resumed, ids[cut:])
        assert "".join(sent[:cut]) + "".join(rest) == want, cut
        assert resumed.stop_matched == whole.stop_matched, cut

def check_stop(tok, text: str, stop: tuple[str, ...], include: bool = False, step: int = 1):
    ids = tok.encode(text)
    full = tok.decode(ids)
    detok = IncrementalDetokenizer(
        tok, tok.encode(PROMPT), stop=stop, include_stop_str_in_output=include
    )
    deltas = stream(detok, ids, step)
    # The stop that completes first wins; at the same end, the longer (it started first).
    ends = [(full.find(s) + len(s), -len(s), s) for s in stop if s in full]
    end, minus_length, matched = min(ends)
    pos, length = end + minus_length, -minus_length
    assert detok.stop_matched == matched
    assert detok.text == full[: pos + length if include else pos]
    assert "".join(deltas) == detok.text
    if not include:
        # No delta ever showed the start of the stop string that then matched.
        emitted = ""
        for d in deltas:
            emitted += d
            assert len(emitted) <= pos
    return detok, deltas


def test_stop_in_middle(tok) -> None:
    detok, _ = check_stop(tok, "The quick brown fox jumps over the lazy dog.", (" fox",))
    assert detok.text == "The quick brown"


def test_stop_spanning_two_tokens(tok) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    ids = tok.encode(text)
    pieces = [tok.decode([i]) for i in ids]
    stop = pieces[3][-2:] + pieces[4][:2]  # straddles the token boundary
    detok, _ = check_stop(tok, text, (stop,))
    assert detok.stop_matched == stop


def test_stop_multibyte(tok) -> None:
    check_stop(tok, MULTIBYTE[1], ("🎉🎉",))
    check_stop(tok, MULTIBYTE[2], ("本語",))


def test_the_stop_that_completes_first_wins(tok) -> None:
    text = "alpha beta gamma delta epsilon"
    for stop in [("delta", "beta"), ("a delta", "mma"), ("mma d", "a de")]:
        check_stop(tok, text, stop)
    # "gamma delta" starts first, but "mma" completes first: in one update as in many.
    for step in (1, 1000):
        detok, _ = check_stop(tok, text, ("gamma delta", "mma"), step=step)
        assert detok.stop_matched == "mma"
        assert detok.text == "alpha beta ga"
    # At the same end, the longer one.
    detok, _ = check_stop(tok, text, ("ta", "beta", "eta"), step=1000)
    assert detok.stop_matched == "beta" and detok.text == "alpha "


@pytest.mark.parametrize("step", [1, 2, 1000])
def test_include_stop_str(tok, step: int) -> None:
    detok, _ = check_stop(tok, "one two three four", (" three",), include=True, step=step)
    assert detok.text == "one two three"


def test_hold_back_partial_stop(tok) -> None:
    # " ST", "O" could start " STOP": held back until "MP" rules it out.
    ids = tok.encode("say STOMP or STOP now")
    assert [tok.decode([i]) for i in ids][:7] == ["say", " ST", "O", "MP", " or", " ST", "OP"]
    detok = IncrementalDetokenizer(tok, [], stop=(" STOP",))
    deltas = stream(detok, ids)
    assert deltas == ["say", "", "", " STOMP", " or", "", ""]
    assert detok.stop_matched == " STOP"
    assert detok.text == "say STOMP or"


def test_prompt_ending_mid_character(tok) -> None:
    ids = tok.encode("🎉 party 🎉")
    for cut in range(1, 4):
        detok = IncrementalDetokenizer(tok, ids[:cut])
        deltas = stream(detok, ids[cut:])
        assert "".join(deltas) == tok.decode(ids[cut:]) == detok.text


def test_flush_releases_held_text(tok) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=("abcdef",))
    out = detok.update(tok.encode("hello abc"))
    assert out == "hello "
    assert detok.text == "hello abc"
    assert detok.flush() == "abc"
    assert detok.stop_matched is None


def test_batched_updates_match_single(tok) -> None:
    text = "Some text 🎉 with 世界 and a STOP word after STOP."
    ids = tok.encode(text)
    for stop in [(), ("STOP",), ("世界",)]:
        results = set()
        for step in (1, 2, 3, 5, len(ids)):
            detok = IncrementalDetokenizer(tok, tok.encode(PROMPT), stop=stop)
            joined = "".join(stream(detok, ids, step))
            assert joined == detok.text
            results.add((detok.text, detok.stop_matched))
        assert len(results) == 1, results


def test_update_after_stop_raises(tok) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=("b",))
    detok.update(tok.encode("a b c"))
    assert detok.stop_matched == "b"
    with pytest.raises(RuntimeError):
        detok.update([42])
    assert detok.flush() == ""

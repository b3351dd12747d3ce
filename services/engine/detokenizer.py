"""Incremental detokenization of output token ids, with stop strings.

Each step decodes only a small window of token ids: the tokens already turned into text
last step (`_prefix_offset:_read_offset`) plus the new ones, and emits the difference, as
vLLM and TGI do. Text is held back while it ends in an incomplete UTF-8 character, and
while its tail could still be the start of a stop string. Stop strings are matched by one
automaton over all of them (stop_matcher.py): O(new text) a step, however many there are.
Until more than `min_tokens` tokens are out, a stop string that completes is passed over
(the automaton scans on), so a stop can only end the text of a later token.
"""

from __future__ import annotations

from typing import cast

from transformers import PreTrainedTokenizerBase

from .stop_matcher import StopMatcher

PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a stream of output token ids into text deltas, and applies stop strings."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        stop: tuple[str, ...] = (),
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self._tokenizer = tokenizer
        self._min_tokens = min_tokens
        self._num_output = 0  # output tokens given to update()
        self._skip_special_tokens = skip_special_tokens
        self._include_stop = include_stop_str_in_output
        self._stops = StopMatcher(tuple(s for s in stop if s))
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        # A prompt ending mid-character would make the window's prefix text unstable.
        if self._decode(context).endswith(REPLACEMENT_CHAR):
            context = []
        self._ids = context  # prompt context, then all output ids
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._text = ""  # output text decoded so far (truncated at a stop)
        self._emitted = 0  # how much of self._text was returned as deltas
        self._stop_matched: str | None = None

    @property
    def text(self) -> str:
        return self._text

    @property
    def stop_matched(self) -> str | None:
        return self._stop_matched

    def update(self, new_token_ids: list[int]) -> str:
        """Add tokens; return the new text that is safe to emit now. Several tokens at
        once give the text, and leave the state, of one at a time: a request resumed
        elsewhere replays its streamed tokens in one call and must go on as its stream
        would have (a window ending mid-character would hold back all of its text, and
        then send again what the stream had sent; under min_tokens, whether a stop string
        counts depends on the token that completes it)."""
        if self._stop_matched is not None:
            raise RuntimeError("update() after a stop string matched")
        for token in new_token_ids:
            self._num_output += 1
            self._ids.append(token)
            self._append(self._decode_new(final=False))
            if self._stop_matched is not None:
                return self._take(len(self._text))
        return self._take(len(self._text) - self._stops.held)

    def flush(self) -> str:
        """The request ended for another reason: return any text still held back."""
        if self._stop_matched is None:
            self._append(self._decode_new(final=True))
        return self._take(len(self._text))

    def _decode(self, ids: list[int]) -> str:
        text = self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)
        return cast(str, text)  # one sequence of ids: one string

    def _decode_new(self, final: bool) -> str:
        """Text of the tokens past `_read_offset`; "" while it ends mid-character."""
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if not final and (len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR)):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return new_text[len(prefix_text) :]

    def _append(self, delta: str) -> None:
        """Add decoded text, and cut it at the first stop string that completes in it."""
        if not delta:
            return
        found = self._stops.feed(delta)
        start = 0  # where the scan that found it began in delta
        while found is not None and self._num_output <= self._min_tokens:
            start += found[0]
            found = self._stops.feed(delta[start:])
        if found is None:
            self._text += delta
            return
        end, self._stop_matched = start + found[0], found[1]
        self._text += delta[:end]
        if not self._include_stop:
            self._text = self._text[: len(self._text) - len(self._stop_matched)]
        self._emitted = min(self._emitted, len(self._text))

    def _take(self, end: int) -> str:
        end = max(end, self._emitted)
        delta = self._text[self._emitted : end]
        self._emitted = end
        return delta

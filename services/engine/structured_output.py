"""Structured output: grammars compiled by xgrammar, one matcher per request, and the
batch's allowed-token mask applied to the logits before sampling.

    before add:   compile(constraint) -> CompiledGrammar    (grammar_compiler.py: its own
                                                             threads, a time limit, an LRU)
    add_request:  GrammarMatcher(compiled)  on the request   (its state: the output so far)
    each step:    fill one bitmask row per sampling row of a constrained request (in a
                  thread, while the forward pass runs); logits[row] = -inf where the bit is 0
    after it:     the matcher accepts each emitted token; once it terminates, the request
                  ends (finish reason "stop")

A constraint with `start_after` token ids (a reasoning model's "</think>") waits: until
the output holds them in a row its rows are left free (all ones) and its tokens go
untested; from the token after them on, the matcher takes over.

The mask is 32 tokens per int32 word: bit (t % 32) of word t // 32 says token t may come
next. Rows of requests without a constraint are never touched.

xgrammar loads on the first constrained request; an engine that never sees one never
imports it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch


class GrammarState:
    """A request's matcher. `accept` takes emitted tokens; `terminated` says the
    constraint is complete (a stop token was accepted). With `start_after`, the matcher
    sees only the tokens after those ids have come in a row."""

    def __init__(self, matcher, start_after: Sequence[int] = ()):
        self.matcher = matcher
        self.start_after = tuple(start_after)
        self.started = not self.start_after
        self._tail: tuple[int, ...] = ()  # the last output tokens while not started

    def accept(self, token_id: int) -> bool:
        if self.started:
            return self.matcher.accept_token(token_id)
        self._tail = (*self._tail, token_id)[-len(self.start_after):]
        self.started = self._tail == self.start_after
        return True

    @property
    def terminated(self) -> bool:
        return self.started and self.matcher.is_terminated()

    def _try(self, token_id: int) -> tuple[bool, int]:
        """accept(token_id) for a look ahead: (accepted, matcher tokens to roll back)."""
        matched = self.started
        ok = self.accept(token_id)
        return ok, int(matched and ok)

    def _restore(self, saved: tuple, matched: int) -> None:
        self.started, self._tail = saved
        if matched:
            self.matcher.rollback(matched)

    def valid_prefix(self, tokens: list[int]) -> list[int]:
        """The longest prefix of `tokens` (draft tokens) the constraint allows; the
        state is left as it was."""
        n = matched = 0
        saved = (self.started, self._tail)
        try:
            for t in tokens:
                if self.terminated:
                    break
                ok, m = self._try(t)
                if not ok:
                    break
                n, matched = n + 1, matched + m
        finally:
            self._restore(saved, matched)
        return tokens[:n]

    def fill(self, bitmask: torch.Tensor, row: int, drafts: list[int]) -> None:
        """Rows row .. row + len(drafts): the mask now, then after each draft token
        (drafts were cut to a valid prefix, so each is accepted). Before the start any
        token may come (all ones). After a draft that ends the constraint (a stop token)
        no token may follow: an empty row, which the walk never reaches (the stop token
        ends the request)."""
        matched = 0
        saved = (self.started, self._tail)
        try:
            for j in range(len(drafts) + 1):
                if j:
                    matched += self._try(drafts[j - 1])[1]
                if not self.started:
                    bitmask[row + j] = -1
                elif self.matcher.is_terminated():
                    bitmask[row + j] = 0
                else:
                    self.matcher.fill_next_token_bitmask(bitmask, row + j)
        finally:
            self._restore(saved, matched)


class BatchMask:
    """The step's bitmask: filled in a background thread while the model runs, then
    applied to the rows that have a constraint."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.words = -(-vocab_size // 32)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._bitmask = torch.zeros(0, self.words, dtype=torch.int32)
        self.fill_s = self.apply_s = 0.0  # seconds spent, for the benchmark

    def start(self, num_rows: int, jobs: list[tuple[GrammarState, int, list[int]]]
              ) -> Future | None:
        """Fill the rows of `jobs` (state, first row, drafts); None if there are none."""
        if not jobs:
            return None
        if self._bitmask.shape[0] < num_rows:
            # A normal tensor even when the step runs in inference mode: the filling
            # thread writes it outside that mode.
            with torch.inference_mode(False):
                self._bitmask = torch.zeros(max(num_rows, 2 * self._bitmask.shape[0]),
                                            self.words, dtype=torch.int32)
        bitmask = self._bitmask

        def fill() -> list[int]:
            t0 = time.perf_counter()
            rows = []
            for state, row, drafts in jobs:
                state.fill(bitmask, row, drafts)
                rows.extend(range(row, row + len(drafts) + 1))
            self.fill_s += time.perf_counter() - t0
            return rows

        return self._pool.submit(fill)

    def apply(self, logits: torch.Tensor, pending: Future) -> list[int]:
        """Mask the constrained rows of `logits` in place (-inf where not allowed).
        Returns the rows whose mask allows no token at all (their logits are left
        unmasked, so that sampling stays defined; the engine ends those requests)."""
        rows = pending.result()
        t0 = time.perf_counter()
        # Little-endian words: byte j of word w holds tokens 32w + 8j ... 32w + 8j + 7,
        # lowest bit first, which is numpy's bitorder="little".
        words = self._bitmask[rows].numpy()
        bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")
        allowed = torch.from_numpy(bits[:, :logits.shape[1]].view(np.bool_))
        dead = ~allowed.any(dim=1)
        if bool(dead.any()):
            allowed[dead] = True
        forbid = (~allowed).to(logits.device, non_blocking=True)
        if rows == list(range(logits.shape[0])):
            logits.masked_fill_(forbid, float("-inf"))
        else:
            idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
            logits[idx] = logits[idx].masked_fill(forbid, float("-inf"))
        self.apply_s += time.perf_counter() - t0
        return [r for r, d in zip(rows, dead.tolist(), strict=True) if d]

    def close(self) -> None:
        self._pool.shutdown(wait=False)

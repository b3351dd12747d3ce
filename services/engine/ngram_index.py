"""A request's n-gram index, which the n-gram proposer (spec_decode.py) drafts from: each
n-gram of its tokens maps to the position of the token after its latest occurrence. It
grows by hi - lo + 1 entries per token, so a lookup is O(hi)."""

from __future__ import annotations


class NgramIndex:
    """n-gram -> position of the token after its latest occurrence, for n in [lo, hi]."""

    def __init__(self, lo: int, hi: int):
        self.lo, self.hi = lo, hi
        self.follower: dict[tuple[int, ...], int] = {}
        self.upto = 0  # tokens[:upto] are indexed

    def extend(self, tokens: list[int]) -> None:
        # The n-gram ending just before position j has the follower j.
        for j in range(max(self.upto, 1), len(tokens)):
            for n in range(self.lo, min(self.hi, j) + 1):
                self.follower[tuple(tokens[j - n:j])] = j
        self.upto = len(tokens)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        # The trailing n-gram has no follower yet, so a hit is always an earlier one.
        self.extend(tokens)
        for n in range(min(self.hi, len(tokens)), self.lo - 1, -1):
            j = self.follower.get(tuple(tokens[-n:]))
            if j is not None:
                return tokens[j:j + k]
        return []

"""Ways to cut a text into stream deltas, for tests that a streamed parse equals the whole
one: one piece, a character at a time, two pieces (at every point of a short text, at
about 120 evenly spaced points of a long one), and random chunkings from a fixed seed."""

from __future__ import annotations

import random


def splits(text: str, chunkings: int = 12, seed: int = 27) -> list[list[str]]:
    out = [[text], list(text)]
    out += [[text[:i], text[i:]] for i in range(1, len(text), max(1, len(text) // 120))]
    rng = random.Random(seed)
    for _ in range(chunkings):
        pieces, i = [], 0
        while i < len(text):
            n = rng.randint(1, 9)
            pieces.append(text[i:i + n])
            i += n
        out.append(pieces)
    return out

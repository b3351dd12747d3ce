"""Stop strings found in text as it grows: Aho-Corasick over the stop strings.

Each new character moves the automaton by one transition (plus failure links, which
amortize to O(1) a character), whatever the number of stop strings. A state is the
longest tail of the text that begins some stop string, so its depth is exactly how many
trailing characters must be held back: they could still turn into a stop.

    stops "he", "she", "hers"      text "ushe"
    after "u": root (0 held)   "s": "s" (1)   "h": "sh" (2)   "e": "she" -> match "she"
"""

from __future__ import annotations

from collections import deque


def _automaton(stops: tuple[str, ...]) -> tuple[list, list, list, list]:
    """(edges, fail, depth, stop) per node: O(total length of the stop strings)."""
    edges: list[dict[str, int]] = [{}]  # the trie: node -> {character: child}
    depth: list[int] = [0]
    stop: list[str | None] = [None]  # the longest stop string that ends at the node
    for s in stops:
        node = 0
        for ch in s:
            child = edges[node].get(ch)
            if child is None:
                child = edges[node][ch] = len(edges)
                edges.append({})
                depth.append(depth[node] + 1)
                stop.append(None)
            node = child
        stop[node] = s
    fail = [0] * len(edges)
    queue = deque(edges[0].values())  # the root's children fail to the root
    while queue:  # breadth first: a node's fail is shallower, so already known
        node = queue.popleft()
        for ch, child in edges[node].items():
            f = fail[node]
            while f and ch not in edges[f]:
                f = fail[f]
            f = fail[child] = edges[f].get(ch, 0)
            if stop[child] is None:  # a shorter stop string that ends here
                stop[child] = stop[f]
            queue.append(child)
    return edges, fail, depth, stop


class StopMatcher:
    """Fed text piece by piece; reports the first stop string that completes (at the
    same end, the longer one: it started first)."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._next, self._fail, self._depth, self._stop = _automaton(stops)
        self._state = 0

    @property
    def held(self) -> int:
        """Trailing characters of the text fed so far that could begin a stop string."""
        return self._depth[self._state]

    def feed(self, text: str) -> tuple[int, str] | None:
        """Advance over `text`. At the first stop string that completes, stop there and
        return (the index in `text` just past it, the stop string); else None."""
        if not self._next[0]:  # no stop strings: nothing to scan
            return None
        edges, fail, stop, state = self._next, self._fail, self._stop, self._state
        for i, ch in enumerate(text):
            while state and ch not in edges[state]:
                state = fail[state]
            state = edges[state].get(ch, 0)
            if stop[state] is not None:
                self._state = state
                return i + 1, stop[state]
        self._state = state
        return None

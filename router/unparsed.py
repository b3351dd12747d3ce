"""What a request costs the router before it is admitted, bounded for all callers at once:

    bytes      an HTTP body as it is read, a gRPC message as it arrives: held against one
               budget for every request of both APIs until parsed; past it,
               RESOURCE_EXHAUSTED / 429, so a crowd of bodies waiting for the parse threads
               (or trickling in) cannot fill the router's memory
    parses     at most `per_key` parses in flight (queued or running on the parse threads)
               per API key; a key's others wait their turn here, never in the threads'
               queue, so a key that floods it delays another key's parse by at most its
               own `per_key` (without API keys every caller is one key)

Both are touched only on the event loop.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor

from baton.services.rpc.errors import Overloaded


class ByteBudget:
    def __init__(self, total: int):
        self.total, self.held = total, 0

    def hold(self) -> Held:
        return Held(self)

    def check(self, count: int) -> None:
        """Overloaded when `count` more bytes would not fit now."""
        if self.held + count > self.total:
            raise Overloaded(f"the router holds {self.held} bytes of requests not yet "
                             f"parsed (limit {self.total}, --max-unparsed-bytes)")


class Held:
    """One request's bytes under the budget: taken as they come, given back once."""

    def __init__(self, budget: ByteBudget):
        self.budget, self.bytes = budget, 0

    def take(self, count: int) -> None:
        """Holds `count` more bytes, or raises Overloaded (and holds none of them)."""
        self.budget.check(count)
        self.budget.held += count
        self.bytes += count

    def release(self) -> None:
        self.budget.held -= self.bytes
        self.bytes = 0


class ParseTurns:
    def __init__(self, pool: Executor, per_key: int):
        self.pool, self.per_key = pool, per_key
        self._turns: dict[str, asyncio.Semaphore] = {}
        self._users: dict[str, int] = {}  # key -> callers holding or waiting for a turn

    async def run(self, key: str, fn, *args):
        """fn(*args) on the pool in `key`'s turn. A turn ends when fn does: a caller
        that leaves while fn runs frees no turn for its key's next parse."""
        turn = self._turns.setdefault(key, asyncio.Semaphore(self.per_key))
        self._users[key] = self._users.get(key, 0) + 1
        try:
            await turn.acquire()
        except BaseException:
            self._leave(key)
            raise
        loop = asyncio.get_running_loop()
        try:
            done = self.pool.submit(fn, *args)
        except BaseException:
            self._end(key, turn)
            raise
        done.add_done_callback(lambda _: self._end_soon(loop, key, turn))
        return await asyncio.wrap_future(done)

    def _end_soon(self, loop: asyncio.AbstractEventLoop, key: str,
                  turn: asyncio.Semaphore) -> None:
        """From the pool's thread (or the loop's, for a parse cancelled in the queue)."""
        try:
            loop.call_soon_threadsafe(self._end, key, turn)
        except RuntimeError:  # the loop has closed: no one waits for a turn any more
            pass

    def _end(self, key: str, turn: asyncio.Semaphore) -> None:
        turn.release()
        self._leave(key)

    def _leave(self, key: str) -> None:
        self._users[key] -= 1
        if not self._users[key]:  # no one holds or waits for a turn: forget the key
            del self._users[key], self._turns[key]

    def keys(self) -> int:
        return len(self._turns)

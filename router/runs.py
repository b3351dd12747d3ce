"""The choices of one request (OpenAI's n, or VllmEngine's), running side by side over
the router's one path.

For each prompt, choice 0 starts first; once it has its first token its prompt's KV is
in the prefix cache, and the prompt's other n-1 choices start and hit it: the shared
prompt is computed once. Every choice's slot of --max-inflight is taken before the run
starts (`Admission`), so a choice that starts later is never refused mid-stream. Events
come out in arrival order; the first error ends them all. Closing the run (the client
left) closes every choice's stream, which cancels the worker calls and frees their
blocks, and gives back the slots of choices that never started. The events wait in a
bounded queue: a client that reads slowly holds its choices' streams back (and with
them the workers' calls), never a growing pile of replies on the router.
"""

from __future__ import annotations

import asyncio
from contextlib import aclosing

from baton.v1 import generation_pb2 as gen

from .core import Admission, Router
from .reply import Caller

QUEUED = 64  # replies of a request waiting for its client, over all of its choices


def answer_size(requests: list[gen.GenerateRequest]) -> tuple[int, int, int]:
    """(max_tokens, top logprobs, tokens and logprobs in all) that the answer of a
    request's choices may hold, reckoned as vLLM's users would: choices x max_tokens x
    (1 + top logprobs). Every front door holds it to --max-answer-tokens before anything
    runs."""
    if not requests:
        return 0, 0, 0
    s = requests[0].sampling  # every choice's is the same, but for its seed
    top = s.logprobs if s.HasField("logprobs") else 0
    return s.max_tokens, top, len(requests) * s.max_tokens * (1 + top)


class Run:
    def __init__(self, router: Router, requests: list[gen.GenerateRequest], n: int,
                 caller: Caller, admission: Admission):
        self.router, self.requests, self.n, self.caller = router, requests, n, caller
        self.admission = admission  # one slot per request
        self._events: asyncio.Queue = asyncio.Queue(QUEUED)
        self._tasks: list[asyncio.Task] = []
        self._open = len(requests)

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        for lead in range(0, len(self.requests), self.n):
            first = asyncio.Event()
            self._tasks.append(loop.create_task(self._pump(lead, first)))
            if self.n > 1:
                self._tasks.append(loop.create_task(self._follow(lead, first)))

    async def _follow(self, lead: int, first: asyncio.Event) -> None:
        await first.wait()
        loop = asyncio.get_running_loop()
        for i in range(lead + 1, lead + self.n):
            self._tasks.append(loop.create_task(self._pump(i, None)))

    async def _pump(self, i: int, first: asyncio.Event | None) -> None:
        try:
            replies = self.router.generate(self.requests[i], self.caller, self.admission)
            async with aclosing(replies) as out:
                async for reply in out:
                    if first is not None:
                        first.set()
                    await self._events.put((i, reply, None))
            await self._events.put((i, None, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            await self._events.put((i, None, e))
        finally:
            if first is not None:
                first.set()  # the others go on (and meet the same error, if any)

    async def events(self):
        """(choice index, reply) in arrival order, until every choice has ended; the
        first error is raised."""
        while self._open:
            i, reply, error = await self._events.get()
            if error is not None:
                raise error
            if reply is None:
                self._open -= 1
                continue
            yield i, reply

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.admission.release(self.admission.held)

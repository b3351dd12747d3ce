"""Server-sent events to a client that must keep reading them.

The server holds each send while the connection's buffers are full: the kernel's, then
uvicorn's own write buffer, which it drains before it takes the next send. A send held
for --stream-stall-timeout means the client has read nothing for that long, and the
stream is cut there: the events are closed, which ends the request everywhere (the
worker calls cancelled, the requests aborted, their KV blocks freed), and the response is
left unfinished, so the server closes the connection and the client, once it reads
again, sees a broken stream rather than a whole one. Upstream, the run's queue is bounded
(runs.py): while a send is held, nothing more is taken from the workers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator
from typing import cast

from starlette.responses import StreamingResponse
from starlette.types import Message, Send

log = logging.getLogger(__name__)


class _Stalled(Exception):
    pass


class EventStream(StreamingResponse):
    def __init__(self, events: AsyncGenerator[str, None], stall_s: float):
        super().__init__(events, media_type="text/event-stream")
        self.stall_s = stall_s

    async def stream_response(self, send: Send) -> None:
        async def timed(message: Message) -> None:
            try:
                async with asyncio.timeout(self.stall_s):
                    await send(message)
            except TimeoutError:
                raise _Stalled from None

        try:
            await super().stream_response(timed)
        except _Stalled:
            log.warning("a client read nothing of its stream for %g s "
                        "(--stream-stall-timeout): the stream is cut and its request "
                        "aborted", self.stall_s)
            # Ours is an async generator (app.py): closed, it ends the run, every choice,
            # everywhere.
            await cast(AsyncGenerator, self.body_iterator).aclose()

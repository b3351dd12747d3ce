"""A kept-alive HTTP connection the router ends is ended in the open: an answer that comes
before its request's body is all in (a refusal) says `connection: close`, so that no
client sends its next request into a connection being closed, where it would get no
answer at all (router/openai/server.py, "answered"). The body is held back by the test,
so the order is certain; a request whose body is in keeps its connection."""

from __future__ import annotations

import asyncio

from tests.integration.test_abuse_admit import HANG_S, _answer, _connect, _router

KEY = "key-a"
HEAD = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n%s\r\n")
BODY = b'{"model": "fake", "prompt": "hi", "max_tokens": 1}'
HEALTH = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"


async def _head(reader) -> bytes:
    return await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HANG_S)


def test_an_answer_before_the_body_says_the_connection_closes(tok):
    async def main():
        async with _router(tok, keys=(KEY,)) as (_, base, polls):
            port = int(base.rsplit(":", 1)[1])
            # Refused on its headers (no key) while its body is still to come.
            reader, writer = await _connect(port, HEAD % (len(BODY), b""))
            head = await _head(reader)
            assert head.startswith(b"HTTP/1.1 401 ") and \
                b"\r\nconnection: close\r\n" in head.lower(), head
            # What the client sends next is not answered, as the answer said.
            writer.write(BODY + HEALTH)
            rest = await _answer(reader)
            assert b"HTTP/1.1" not in rest, rest
            writer.close()

            # Its body in, a request keeps the connection: the next one is answered on it.
            reader, writer = await _connect(port, HEAD % (len(BODY), b"") + BODY)
            head = await _head(reader)
            assert head.startswith(b"HTTP/1.1 401 ") and b"connection: close" not in \
                head.lower(), head
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            writer.write(HEALTH)
            assert (await _head(reader)).startswith(b"HTTP/1.1 200 ")
            writer.close()
            while len(polls) < 2:  # the router's check that /health answered meanwhile
                await asyncio.sleep(0.01)

    asyncio.run(main())

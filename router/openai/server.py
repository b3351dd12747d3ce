"""uvicorn in the router's own event loop, beside the gRPC server: one process, one loop,
one router. Signals stay with the gRPC server's drain, which stops this server last.

What a connection may hold before its request reaches the app is bounded here (the body,
once the headers are in, by the app's Guard):

    connections   past --max-http-connections open at once, a new one gets 503 and is
                  closed before anything of it is read; those open are served as ever
    headers       in within --http-header-timeout of the connection opening (or of the
                  first byte of the next request on a kept-alive one), else 408, closed;
                  at most HEADER_BYTES of them (h11's bound on an incomplete event)
    answered      a request answered before its body is all in (refused, or a route
                  that reads none): the answer says `connection: close` and the
                  connection is closed after it, the rest never waited for. (Said in
                  the answer: a client that reused the connection would send its next
                  request into a closing one, and get no answer at all.)
    idle          a kept-alive connection with no next request: closed after
                  KEEP_ALIVE_S (uvicorn's timeout_keep_alive)

The first three close "lingering", as nginx does: the answer and an end of stream go out,
and what the client sends meanwhile is dropped until it closes or LINGER_S has passed (a
close with unread bytes would reset the connection, and the client lose the answer).
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import grpc
import uvicorn
from uvicorn.protocols.http import h11_impl

from baton.services.rpc.security import Security
from baton.services.rpc.server import Lifecycle

from ..config import RouterConfig
from ..core import Router
from .app import make_app
from .render import error_body

HEADER_BYTES = 64 * 1024
KEEP_ALIVE_S = 5  # uvicorn's default
LINGER_S = 2.0
# h11's states of a client (the h11 uvicorn runs): between requests, sending a body
h11 = h11_impl.h11  # pyright: ignore[reportPrivateImportUsage] - the one uvicorn imports
IDLE, SEND_BODY = h11.IDLE, h11.SEND_BODY


def _raw_error(status: int, reason: str, code: grpc.StatusCode, message: str) -> bytes:
    """A whole HTTP/1.1 response in OpenAI's error shape that closes its connection,
    written where no request was read (so h11 cannot write it)."""
    body = json.dumps(error_body(code, message)[1]).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


class BoundedH11(h11_impl.H11Protocol):
    """uvicorn's h11 protocol with the connection and header bounds above (the class
    attributes: `bounded` makes a subclass with them)."""

    max_connections: int = 0
    header_timeout: float = 0.0
    refused_reply = timed_out_reply = b""
    refused = lingering = False
    header_timer: asyncio.TimerHandle | None = None

    @classmethod
    def bounded(cls, max_connections: int, header_timeout: float) -> type[BoundedH11]:
        return type("BoundedH11", (cls,), {
            "max_connections": max_connections, "header_timeout": header_timeout,
            "refused_reply": _raw_error(
                503, "Service Unavailable", grpc.StatusCode.UNAVAILABLE,
                f"the router has {max_connections} HTTP connections open, its limit "
                "(--max-http-connections); retry later"),
            "timed_out_reply": _raw_error(
                408, "Request Timeout", grpc.StatusCode.DEADLINE_EXCEEDED,
                f"the request's headers took over {header_timeout:g} s to arrive "
                "(--http-header-timeout)")})

    def connection_made(self, transport) -> None:
        if len(self.connections) >= self.max_connections:
            self.refused, self.transport = True, transport
            self._close(self.refused_reply)
            return
        super().connection_made(transport)
        self._await_headers()

    def connection_lost(self, exc) -> None:
        if self.refused:
            return
        self._headers_in()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.lingering:
            return
        super().data_received(data)
        if self.conn.their_state is IDLE:  # a request's headers are on their way
            self._await_headers()
        else:
            self._headers_in()

    def handle_events(self) -> None:
        super().handle_events()  # where uvicorn starts each request's cycle
        cycle = self.cycle
        if cycle is not None and "send" not in vars(cycle):
            cycle.send = self._announcing(cycle)

    def _announcing(self, cycle):
        """The cycle's ASGI `send`, with the "answered" bound: an answer that starts before
        its request's body is all in says `connection: close` (so h11 ends the connection
        after it), and that end is a lingering close (uvicorn's own would be abrupt)."""
        send = cycle.send

        async def announcing(message) -> None:
            if message["type"] == "http.response.start" and \
                    self.conn.their_state is SEND_BODY:
                message = {**message, "headers": [*message.get("headers", ()),
                                                  (b"connection", b"close")]}
                cycle.transport = _Lingering(self)
            await send(message)

        return announcing

    def _await_headers(self) -> None:
        if self.header_timer is None:
            self.header_timer = self.loop.call_later(self.header_timeout, self._too_slow)

    def _headers_in(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def _too_slow(self) -> None:
        self.header_timer = None
        if self.conn.their_state is IDLE and not self.transport.is_closing():
            self._close(self.timed_out_reply)

    def _close(self, reply: bytes = b"") -> None:
        """`reply`, then a lingering close (above); over TLS, a plain one."""
        transport = self.transport
        if self.lingering:
            return
        transport.write(reply)
        if not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()
        self.lingering = True
        self.loop.call_later(LINGER_S, transport.close)


class _Lingering:
    """A connection's transport as one answer's cycle sees it: its close() is the
    protocol's lingering one."""

    def __init__(self, protocol: BoundedH11):
        self._protocol = protocol

    def __getattr__(self, name: str):
        return getattr(self._protocol.transport, name)

    def close(self) -> None:
        self._protocol._close()


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield  # SIGTERM belongs to the gRPC server's drain


class HttpServer:
    def __init__(self, config: RouterConfig, router: Router, security: Security,
                 lifecycle: Lifecycle, registries=()):
        app = make_app(router, security, lifecycle, registries, config.http_body_timeout)
        svc = config.service
        self.server = _Server(uvicorn.Config(
            app, host=svc.host, port=config.http_port, log_level="warning", access_log=False,
            lifespan="off", ssl_certfile=svc.tls_cert, ssl_keyfile=svc.tls_key,
            timeout_graceful_shutdown=5, timeout_keep_alive=KEEP_ALIVE_S,
            http=BoundedH11.bounded(config.http_connections(), config.http_header_timeout),
            h11_max_incomplete_event_size=HEADER_BYTES))
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.server.serve())
        while not self.server.started:
            if self._task.done():  # e.g. the port is taken
                self._task.result()
                raise RuntimeError("the HTTP server stopped at start")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self._task is not None:
            self.server.should_exit = True
            await self._task

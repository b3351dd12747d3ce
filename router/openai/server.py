"""uvicorn in the router's own event loop, beside the gRPC server: one process, one loop,
one router. Signals stay with the gRPC server's drain, which stops this server last."""

from __future__ import annotations

import asyncio
import contextlib

import uvicorn

from baton.router.config import RouterConfig
from baton.router.core import Router
from baton.router.openai.app import make_app
from baton.services.rpc.security import Security
from baton.services.rpc.server import Lifecycle


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield  # SIGTERM belongs to the gRPC server's drain


class HttpServer:
    def __init__(self, config: RouterConfig, router: Router, security: Security,
                 lifecycle: Lifecycle, registries=()):
        app = make_app(router, security, lifecycle, registries)
        svc = config.service
        self.server = _Server(uvicorn.Config(
            app, host=svc.host, port=config.http_port, log_level="warning", access_log=False,
            lifespan="off", ssl_certfile=svc.tls_cert, ssl_keyfile=svc.tls_key,
            timeout_graceful_shutdown=5))
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

"""Every error the HTTP API returns, in OpenAI's shape
({"error": {"message", "type", "param", "code"}}), whoever raised it: besides the routes'
own (app.py's ApiError), what FastAPI and Starlette raise (a body that does not validate
or parse, a path or a method the API does not have) and any exception a route lets out
(500, logged once, here)."""

from __future__ import annotations

import logging

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from .render import error_body

log = logging.getLogger(__name__)


def install(app: FastAPI) -> None:
    """The handlers, and the catch-all outside every other middleware (add it last)."""
    app.add_exception_handler(RequestValidationError, _on_invalid)
    app.add_exception_handler(HTTPException, _on_http)
    app.add_middleware(Uncaught)


def _invalid(message: str, param: str | None) -> JSONResponse:
    status, body = error_body(grpc.StatusCode.INVALID_ARGUMENT, message, param)
    return JSONResponse(body, status_code=status)


async def _on_invalid(request: Request, e: Exception) -> JSONResponse:
    assert isinstance(e, RequestValidationError)  # install() registers it for that alone
    first = e.errors()[0] if e.errors() else {}
    param = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
    return _invalid(f"{param or 'the body'}: {first.get('msg')}", param)


async def _on_http(request: Request, e: Exception) -> JSONResponse:
    assert isinstance(e, HTTPException)  # install() registers it for that alone
    where = f"{request.method} {request.url.path}"
    message = {404: f"Invalid URL ({where})",
               405: f"Method not allowed ({where})"}.get(e.status_code, str(e.detail))
    kind = "invalid_request_error" if e.status_code < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": None, "code": None}}
    return JSONResponse(body, status_code=e.status_code, headers=e.headers)


class Uncaught:
    """Any exception a route lets out: logged here, and answered 500 in OpenAI's shape if
    no response had started (a stream that had started just ends). Nothing reaches the
    server's own handler, so the traceback is logged once."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        started = False

        async def watched(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception:
            log.exception("uncaught error on %s %s", scope.get("method"), scope.get("path"))
            if scope["type"] == "http" and not started:
                status, body = error_body(grpc.StatusCode.INTERNAL, "internal server error")
                await JSONResponse(body, status_code=status)(scope, receive, send)

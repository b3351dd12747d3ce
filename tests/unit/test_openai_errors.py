"""Every error the HTTP API returns has OpenAI's shape, whoever raised it: an unknown
path (404), a wrong method (405), a body that is not JSON (400), and an exception no
route caught (500, logged)."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import httpx
import pytest

from baton.router.intake import Intake
from baton.router.openai import app as app_module
from baton.services.rpc.config import ServiceConfig
from baton.services.rpc.security import Security
from baton.services.rpc.server import Lifecycle
from baton.v1 import generation_pb2 as gen


def call(method: str, path: str, model_info=None, **kw) -> httpx.Response:
    info = gen.ModelInfo(model="m", max_model_len=2048)
    intake = Intake(tokenizer=None)
    router = SimpleNamespace(model_info=model_info or (lambda: info), max_inflight=8,
                             inflight=0, intake=intake)
    app = app_module.make_app(router, Security(ServiceConfig(), ()), Lifecycle())

    async def main():
        # The app answers every error itself; none may reach the server.
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=True)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.request(method, path, **kw)

    try:
        return asyncio.run(main())
    finally:
        intake.close()


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param",
                                                             "code"}, body
    return body["error"]


@pytest.mark.parametrize("method, path, status, says", [
    ("GET", "/v1/nowhere", 404, "Invalid URL (GET /v1/nowhere)"),
    ("POST", "/nowhere", 404, "Invalid URL (POST /nowhere)"),
    ("GET", "/v1/completions", 405, "Method not allowed (GET /v1/completions)"),
    ("DELETE", "/health", 405, "Method not allowed (DELETE /health)"),
])
def test_an_unknown_path_or_method(method, path, status, says):
    response = call(method, path)
    error = error_of(response, status)
    assert error["message"] == says and error["type"] == "invalid_request_error"
    if status == 405:
        assert "allow" in response.headers


@pytest.mark.parametrize("content", [b"{not json", b"\xff\xfe", b"[1, 2]"])
def test_a_body_that_is_not_a_json_object(content):
    error = error_of(call("POST", "/v1/completions", content=content,
                          headers={"content-type": "application/json"}), 400)
    assert error["type"] == "invalid_request_error" and error["param"] == "body"


def test_an_uncaught_exception_is_a_500_and_is_logged(caplog):
    def broken():
        raise RuntimeError("the model registry broke")

    with caplog.at_level(logging.ERROR, logger="baton.router.openai.errors"):
        error = error_of(call("GET", "/v1/models", model_info=broken), 500)
    assert error == {"message": "internal server error", "type": "server_error",
                     "param": None, "code": None}  # no internals shown to the caller
    logged = [r for r in caplog.records if r.name == "baton.router.openai.errors"]
    assert len(logged) == 1 and "GET /v1/models" in logged[0].getMessage()
    assert "the model registry broke" in str(logged[0].exc_info[1])

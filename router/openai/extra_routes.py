"""vLLM's routes beside OpenAI's, where vLLM's users look for them, and its request ids:

    POST /tokenize     {"prompt"} or {"messages"} (with an optional "model"; with
                       messages, "tools" and "chat_template_kwargs" as a chat's)
                       -> {"tokens", "count", "max_model_len", "token_strs"}
    POST /detokenize   {"tokens"} -> {"prompt"}
    GET  /version      {"version"}

The three are behind the API key, as every /v1/ route (`guarded`). Tokenizing gives the
ids Generate would feed the model: a prompt with the tokenizer's special tokens, messages
(tool calls, tool results and the tools too) through the chat template with the
assistant's turn opened, as a chat completion renders them (vLLM's defaults; another
`add_special_tokens` or `add_generation_prompt` is refused, naming it). Detokenizing
keeps special tokens, so a tokenized conversation reads back as its template wrote it.

`X-Request-Id` on any request names it: it prefixes the id of every request it starts
(what the workers, their logs and the traces see), becomes the response's `id`
(`chatcmpl-<id>`, `cmpl-<id>`), and comes back as a response header on every route (one
is made for the header when the caller sends none). Visible ASCII only, and short enough
that the ids made from it stay within --max-request-id-chars; another is a 400 naming
the header."""

from __future__ import annotations

import importlib.metadata
import uuid
from typing import TypeVar

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from baton.services.common.limits import ROUTER_ID_CHARS, Limits
from baton.services.rpc.errors import InvalidArgument
from baton.v1 import generation_pb2 as gen

from ..lora.routes import lora_of_model, not_found
from .body import read_body
from .chat_fields import Tool
from .protocol import ChatMessage, chat_of
from .render import error_body

HEADER = "x-request-id"
REQUEST_ID = "baton.request_id"  # in the ASGI scope: this request's id
GIVEN_ID = "baton.given_request_id"  # ... and whether the caller gave it
GUARDED_PATHS = frozenset({"/tokenize", "/detokenize", "/version"})
try:
    VERSION = importlib.metadata.version("baton-llm")
except importlib.metadata.PackageNotFoundError:  # run from a checkout never installed
    VERSION = "0+unknown"


def guarded(path: str) -> bool:
    """Whether a path wants the API key (and counts for the drain)."""
    return path.startswith("/v1/") or path in GUARDED_PATHS


class RequestIds:
    """Every HTTP request gets an id: its X-Request-Id, or one made here, kept in the
    scope for the routes and sent back in the response's X-Request-Id. (Plain ASGI,
    outside every other middleware, so even their refusals carry it.)"""

    def __init__(self, app, limits: Limits):
        self.app = app
        # The router appends its own id of each choice (at most ROUTER_ID_CHARS).
        self.max_chars = limits.max_request_id_chars - ROUTER_ID_CHARS

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = next((v.decode("latin-1") for k, v in scope["headers"]
                      if k.lower() == HEADER.encode()), None)
        if given is not None:
            why = self.refusal(given)
            if why is not None:
                status, body = error_body(grpc.StatusCode.INVALID_ARGUMENT,
                                          f"X-Request-Id: {why}", "X-Request-Id")
                return await JSONResponse(body, status_code=status)(scope, receive, send)
        rid = given or uuid.uuid4().hex
        scope[REQUEST_ID], scope[GIVEN_ID] = rid, given is not None
        echo = (HEADER.encode(), rid.encode("ascii"))

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), echo]}
            await send(message)

        await self.app(scope, receive, send_with_id)

    def refusal(self, rid: str) -> str | None:
        if not rid:
            return "empty"
        if len(rid) > self.max_chars:
            return (f"{len(rid)} characters, over the limit of {self.max_chars} "
                    f"(--max-request-id-chars, less {ROUTER_ID_CHARS} for the router's own)")
        if not all("!" <= c <= "~" for c in rid):
            return "visible ASCII characters only (no spaces or control characters)"
        return None


def tag(request: Request, requests: list[gen.GenerateRequest], renderer) -> None:
    """Name a completion's requests, and its response, after the X-Request-Id the caller
    gave."""
    if not request.scope.get(GIVEN_ID):
        return  # the ids stay the router's own (the header echoes the one made)
    rid = request.scope[REQUEST_ID]
    for r in requests:
        r.request_id = f"{rid}-{r.request_id}"
    renderer.id = f"{renderer.id.split('-', 1)[0]}-{rid}"


class TokenizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # With messages: what the template gets, as a chat completion's (protocol.chat_of).
    tools: list[Tool] | None = None
    chat_template_kwargs: dict | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for chat
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    def request(self) -> gen.TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidArgument("prompt: send a prompt or messages (one of them)")
        chat = self.messages is not None
        if self.add_special_tokens not in (None, not chat):
            raise InvalidArgument(f"add_special_tokens: only {str(not chat).lower()} is "
                                  f"supported with {'messages' if chat else 'a prompt'}")
        if not self.add_generation_prompt:
            raise InvalidArgument("add_generation_prompt: only true is supported")
        if self.messages is None:
            for name in ("tools", "chat_template_kwargs"):
                if getattr(self, name) is not None:
                    raise InvalidArgument(f"{name}: only with messages, not a prompt")
            return gen.TokenizeRequest(text=self.prompt)
        return gen.TokenizeRequest(chat=chat_of(self.messages, self.tools,
                                                self.chat_template_kwargs))


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]



Named = TypeVar("Named", TokenizeBody, DetokenizeBody)  # the bodies that name a model

def install(app: FastAPI, router, api_error_class: type[Exception], api_error) -> None:
    """The routes, and the request ids around everything (call after every other
    middleware is added). `api_error(e, chat)` turns an exception into the app's error
    (an `api_error_class`: raised as it is)."""
    app.add_middleware(RequestIds, limits=router.intake.limits)
    intake = router.intake

    def error(e: Exception, chat: bool = False) -> Exception:
        return e if isinstance(e, api_error_class) else api_error(e, chat)

    async def body_of(request: Request, kind: type[Named]) -> Named:
        body = await read_body(intake, request, kind)
        if body.model is not None and lora_of_model(router, body.model) is None:
            raise api_error_class(*not_found(body.model))  # (adapters share the tokenizer)
        return body

    @app.post("/tokenize")
    async def tokenize(request: Request):
        chat = False
        try:
            body = await body_of(request, TokenizeBody)
            wire = body.request()
            chat = body.messages is not None  # its errors name `messages`, not `prompt`
            ids = await router.tokenize(wire)
            info = router.model_info()
            strs = None
            if body.return_token_strs:
                strs = await intake.run(lambda: [intake.tokenizer.token_text(t) for t in ids])
        except Exception as e:  # noqa: BLE001 - ServiceError, ValueError, the app's own
            raise error(e, chat) from None
        return JSONResponse({"count": len(ids), "max_model_len": info.max_model_len,
                             "tokens": ids, "token_strs": strs})

    @app.post("/detokenize")
    async def detokenize(request: Request):
        try:
            body = await body_of(request, DetokenizeBody)
            vocab = router.model_info().vocab_size or intake.tokenizer.vocab_size
            bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
            if bad is not None:
                raise InvalidArgument(f"tokens: id {bad} is outside the vocabulary "
                                      f"[0, {vocab})")
            admission = router.admit()  # decoding is work too
            try:
                text = await intake.run(intake.tokenizer.decode, body.tokens, False)
            finally:
                admission.release()
        except Exception as e:  # noqa: BLE001
            raise error(e) from None
        return JSONResponse({"prompt": text})

    @app.get("/version")
    async def version():
        return {"version": VERSION}

"""The OpenAI-compatible HTTP API on the router, over the same request path as gRPC
`Generate` (so the same request gives the same tokens):

    POST /v1/chat/completions, /v1/completions   streaming (SSE) or whole
    GET  /v1/models                              the served model and its LoRA adapters
    POST /v1/load_lora_adapter, /v1/unload_lora_adapter   vLLM's (router/lora/routes.py)
    GET  /health                                 200 when the router can serve, else 503
    GET  /metrics                                Prometheus
    POST /tokenize, /detokenize; GET /version    vLLM's (extra_routes.py)

Errors come in OpenAI's JSON shape with the right HTTP status: 400 naming the field, 401
without a valid key, 404 for another model, 408 for a body that takes too long to arrive,
413, 429 with Retry-After, 503, 504. A client that disconnects cancels its request
everywhere; one that stops reading its stream is cut (streams.py). A whole response is
rendered on a thread (render.py).
"""

from __future__ import annotations

import asyncio
import math
from concurrent.futures import ThreadPoolExecutor

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from baton.services.rpc import tracing
from baton.services.rpc.errors import InvalidArgument, Overloaded, ServiceError
from baton.services.rpc.metrics import union
from baton.services.rpc.security import Security
from baton.services.rpc.server import Lifecycle, status_of

from ..core import Router
from ..lora import routes as lora_routes
from ..reply import Caller
from ..runs import Run
from ..unparsed import ByteBudget, Held
from . import errors, extra_routes
from .body import HELD, KEY_ID, parse_body, parsed
from .protocol import ChatRequest, CompletionRequest
from .render import Choice, Renderer, Tally, error_body, event, param_of
from .streams import EventStream

MAX_BODY_BYTES = 64 * 1024 * 1024
# Whole responses are rendered here, never on the event loop: two at a time at most, so
# the loop still gets the interpreter often while big answers render.
RENDER = ThreadPoolExecutor(2, thread_name_prefix="render")


class ApiError(Exception):
    def __init__(self, status: int, body: dict, headers: dict | None = None):
        self.status, self.body, self.headers = status, body, headers or {}


def api_error(e: Exception, chat: bool = False) -> ApiError:
    code, message = status_of(e)
    param = param_of(message, chat) if code.name == "INVALID_ARGUMENT" else None
    status, body = error_body(code, message, param)
    headers = {}
    if status == 429:
        headers["Retry-After"] = str(math.ceil(getattr(e, "retry_after_s", None) or 1))
    return ApiError(status, body, headers)


class Guard:
    """Before anything is parsed or queued: the size of the body, the API key, the
    drain; then the body, read within `body_timeout` seconds (408 past it) and held
    against the `unparsed` budget of every request until the route has parsed it (429
    when spent). Counts the requests in flight for the drain. (Plain ASGI: it wraps
    streams without buffering them.)"""

    def __init__(self, app, security: Security, lifecycle: Lifecycle,
                 unparsed: ByteBudget | None = None, body_timeout: float | None = None):
        self.app, self.security, self.lifecycle = app, security, lifecycle
        self.unparsed = unparsed or ByteBudget(1 << 62)
        self.body_timeout = body_timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not extra_routes.guarded(scope["path"]):
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope["headers"]}
        refusal, length = None, int(headers.get("content-length") or 0)
        key_id = self.security.key_id(headers.get("authorization"))
        if length > MAX_BODY_BYTES:
            refusal = _response(*_too_big())
        elif key_id is None:
            refusal = _response(*error_body(
                grpc.StatusCode.UNAUTHENTICATED,
                "a valid API key is required: 'Authorization: Bearer <key>'"))
        elif self.lifecycle.draining and scope["method"] == "POST":
            refusal = _response(*error_body(grpc.StatusCode.UNAVAILABLE,
                                            "draining: no new requests"))
        held = self.unparsed.hold()
        try:
            body = None
            if refusal is None:
                refusal, body = await self._read(receive, held, length)
            if refusal is not None:
                return await refusal(scope, receive, send)
            if body is None:  # the client left
                return
            # Replayed as it came, never joined here: a 31 MB body is joined (if at all)
            # on the intake's parse threads, not on the event loop.
            replay = iter([{"type": "http.request", "body": chunk,
                            "more_body": i < len(body) - 1} for i, chunk in enumerate(body)])

            async def replayed():
                message = next(replay, None)
                return message if message is not None else await receive()

            scope[KEY_ID] = key_id  # the routes give it to the router's Caller
            scope[HELD] = held  # a route that has parsed the body releases it
            self.lifecycle.inflight += 1
            try:
                await self.app(scope, replayed, send)
            finally:
                self.lifecycle.inflight -= 1
        finally:
            held.release()

    async def _read(self, receive, held: Held, length: int
                    ) -> tuple[JSONResponse | None, list[bytes] | None]:
        """(None, the body's chunks as they came), (a refusal, None), or (None, None)
        when the client left. Its bytes are held as they come; a body that says it
        needs more than the budget has left is refused before any of it is read."""
        body, size, more = [], 0, True
        try:
            self.unparsed.check(length)
            async with asyncio.timeout(self.body_timeout):
                while more:
                    message = await receive()
                    if message["type"] != "http.request":
                        return None, None
                    body.append(message.get("body", b""))
                    size += len(body[-1])
                    more = message.get("more_body", False)
                    if size > MAX_BODY_BYTES:
                        return _response(*_too_big()), None
                    held.take(len(body[-1]))
        except Overloaded as e:
            error = api_error(e)
            return JSONResponse(error.body, status_code=error.status,
                                headers=error.headers), None
        except TimeoutError:
            return _response(408, error_body(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"the body took over {self.body_timeout:g} s to arrive "
                "(--http-body-timeout)")[1]), None
        return None, body


def _response(status: int, body: dict) -> JSONResponse:
    return JSONResponse(body, status_code=status)


def _too_big() -> tuple[int, dict]:
    return 413, error_body(InvalidArgument.code, f"the body is over {MAX_BODY_BYTES} bytes")[1]


def make_app(router: Router, security: Security, lifecycle: Lifecycle,
             registries=(), body_timeout: float | None = None) -> FastAPI:
    app = FastAPI(title="Baton", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(Guard, security=security, lifecycle=lifecycle,
                       unparsed=router.intake.unparsed, body_timeout=body_timeout)
    errors.install(app)  # OpenAI's error shape for the rest, and the catch-all outside
    lora_routes.install(app, router, api_error)
    extra_routes.install(app, router, ApiError, api_error)  # X-Request-Id around it all

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, e: ApiError):
        return JSONResponse(e.body, status_code=e.status, headers=e.headers)

    @app.get("/health")
    async def health():
        ready, why = router.registry.readiness()
        if lifecycle.draining:
            ready, why = False, "draining"
        return JSONResponse({"status": "ok" if ready else "unavailable", "detail": why},
                            status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics():
        text = generate_latest(union([router.metrics.registry, *registries]))
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        try:
            info = router.model_info()
        except ServiceError as e:
            raise api_error(e) from None
        return {"object": "list", "data": lora_routes.model_cards(router, info)}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await complete(request, ChatRequest)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, CompletionRequest)

    async def complete(request: Request, kind: type[ChatRequest | CompletionRequest]):
        chat, intake = kind is ChatRequest, router.intake
        try:
            # Counted, parsed and built on the intake's parse threads (not the
            # tokenizer's), never per item on the event loop (body.py).
            key = request.scope.get(KEY_ID, "")
            try:
                body = await intake.parse(parse_body, await _body(request), kind,
                                          intake.limits, _max_model_len(router), key=key)
            finally:
                parsed(request.scope)
            info = router.model_info()
            lora = lora_routes.lora_of_model(router, body.model)  # a LoRA adapter's name?
            if lora is None:
                raise ApiError(*lora_routes.not_found(body.model))
            count = body.prompt_count() * body.n
            if count > router.max_inflight:
                raise InvalidArgument(f"n: {count} choices are more than the router runs "
                                      f"at once ({router.max_inflight})")
            requests = await intake.parse(body.requests, info.max_model_len,
                                          intake.sampling_defaults, key=key)
            body.check_answer(requests, intake.limits)  # what rendering it may cost
            for r in requests:
                r.lora = lora
            # echo: the prompts' text (token ids decoded on the tokenizer's threads)
            echo = [] if chat else await intake.run(body.echo_texts, intake.tokenizer.decode)
            admission = router.admit(len(requests))  # all choices or none
        except ApiError:
            raise
        except Exception as e:  # noqa: BLE001 - ServiceError, or a value protobuf refused
            raise api_error(e, chat) from None
        want_top = (body.top_logprobs or 0) if chat else (body.logprobs or 0)
        renderer = Renderer(chat, body.model, router.intake.tokenizer.token_text)
        renderer.echo = echo
        extra_routes.tag(request, requests, renderer)  # X-Request-Id names them
        caller = Caller(trace_context=tracing.extract(request.headers),
                        attributes={"baton.user": body.user} if body.user else {},
                        key_id=key)
        run = Run(router, requests, body.n, caller, admission)
        run.start()
        events = run.events().__aiter__()
        watch = asyncio.ensure_future(_disconnected(request))
        try:  # errors before the first token are HTTP errors; a client gone ends it all
            first_event = asyncio.ensure_future(events.__anext__())
            await asyncio.wait({first_event, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not first_event.done():
                first_event.cancel()
                await run.close()
                return Response(status_code=499)
            try:
                first = first_event.result()
            except StopAsyncIteration:
                first = None
        except BaseException as e:
            watch.cancel()
            await run.close()
            if isinstance(e, Exception):
                raise api_error(e, chat) from None
            raise
        if body.stream:  # from here Starlette watches the connection
            watch.cancel()
            include = bool(body.stream_options and body.stream_options.include_usage)
            return EventStream(
                _sse(run, events, first, renderer, len(requests), body.n, want_top, include),
                router.stream_stall_timeout)
        return await _whole(run, events, first, renderer, len(requests), body.n, want_top,
                            watch, chat)

    return app


def _max_model_len(router: Router) -> int | None:
    """The model's, once a worker has said it: a prompt that cannot fit it is refused as
    its body is counted."""
    try:
        return router.model_info().max_model_len or None
    except ServiceError:
        return None


async def _body(request: Request) -> list[bytes]:
    """The body's chunks as they came (the guard read them all), not joined here."""
    return [chunk async for chunk in request.stream() if chunk]


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body is read: only a disconnect is left)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _whole(run: Run, events, first, renderer: Renderer, count: int, n: int,
                 want_top: int, watch: asyncio.Future, chat: bool):
    choices = [Choice(i) for i in range(count)]

    async def collect():
        if first is not None:
            choices[first[0]].add(first[1])
        async for i, reply in events:
            choices[i].add(reply)

    work = asyncio.ensure_future(collect())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():  # the client left: end every choice everywhere
            return Response(status_code=499)
        work.result()
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001
        raise api_error(e, chat) from None
    finally:
        work.cancel()
        watch.cancel()
        await run.close()
    # Rendered a piece at a time, on a render thread: the loop answers meanwhile.
    body = await asyncio.get_running_loop().run_in_executor(
        RENDER, renderer.whole_json, choices, n, want_top)
    return Response(body, media_type="application/json")


async def _sse(run: Run, events, first, renderer: Renderer, count: int, n: int,
               want_top: int, include_usage: bool):
    choices = [Tally(i) for i in range(count)]  # the usage counts: the chunks went out
    started: set[int] = set()

    def chunk(i: int, reply) -> str:
        choices[i].add(reply)
        body = renderer.chunk(i, reply, i not in started, want_top, include_usage)
        started.add(i)
        return event(body)

    try:
        if first is not None:
            yield chunk(*first)
        async for i, reply in events:
            yield chunk(i, reply)
        if include_usage:
            yield event(renderer.usage_chunk(choices, n))
    except Exception as e:  # noqa: BLE001 - headers are out: the error goes in the stream
        yield event(api_error(e, renderer.chat).body)
    finally:
        await run.close()
    yield "data: [DONE]\n\n"

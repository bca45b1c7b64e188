"""The ASGI application (Starlette): OpenAI-compatible routes over the engine loop.

    POST /v1/completions        POST /v1/chat/completions      GET /v1/models
    GET  /health                GET  /metrics

`/v1/*` requires `Authorization: Bearer <key>` when the server has an API key; `/health`
and `/metrics` never do. Errors are OpenAI-shaped JSON bodies (see protocol.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable

import attrs
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from servelab.errors import RequestError
from servelab.server.chat import ChatTemplate
from servelab.server.engine_loop import AsyncEngine, EngineUnavailable
from servelab.server.generation import EngineFailure, Generation
from servelab.server.metrics import ServerMetrics
from servelab.server.protocol import (ApiError, GenerationRequest, bad_request, check_model, parse_chat,
                                      parse_completion, parse_json, request_error)
from servelab.server.responses import chat_body, chat_chunks, completion_body, completion_chunks

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_REJECT_REASONS = {400: "invalid", 401: "unauthorized", 429: "overloaded", 499: "client_closed", 500: "error",
                   503: "unavailable"}


@attrs.define
class ServerState:
    """Everything the routes share."""

    engine: AsyncEngine
    metrics: ServerMetrics
    model_name: str
    max_model_len: int
    max_waiting: int
    api_key: str | None = None
    chat_template: ChatTemplate = attrs.field(factory=lambda: ChatTemplate(None))
    is_draining: Callable[[], bool] = lambda: False

    @property
    def tokenizer(self) -> Any:
        return self.engine.engine.tokenizer


def build_app(state: ServerState) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        state.engine.start()
        try:
            yield
        finally:
            await state.engine.shutdown()

    routes = [
        Route("/health", _health, methods=["GET"]),
        Route("/metrics", _metrics, methods=["GET"]),
        Route("/v1/models", _guarded(_models), methods=["GET"]),
        Route("/v1/completions", _guarded(_completions), methods=["POST"]),
        Route("/v1/chat/completions", _guarded(_chat_completions), methods=["POST"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={Exception: _internal_error})
    app.state.servelab = state
    return app


def _state(request: Request) -> ServerState:
    return request.app.state.servelab


def _guarded(handler: Callable[[Request, ServerState], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """Authentication, draining and ApiError -> an OpenAI error response."""

    async def endpoint(request: Request) -> Response:
        state = _state(request)
        try:
            _check_api_key(request, state.api_key)
            if state.is_draining():
                raise ApiError(503, "the server is shutting down", type="server_error", code="shutting_down",
                               headers={"Retry-After": "5"})
            return await handler(request, state)
        except ApiError as exc:
            state.metrics.reject(_REJECT_REASONS.get(exc.status, str(exc.status)))
            return error_response(exc)

    return endpoint


def error_response(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    return error_response(ApiError(500, f"internal server error: {type(exc).__name__}", type="server_error"))


def _check_api_key(request: Request, api_key: str | None) -> None:
    if api_key is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), api_key.encode()):
        raise ApiError(401, "invalid or missing API key: send Authorization: Bearer <key>",
                       code="invalid_api_key")


async def _health(request: Request) -> Response:
    state = _state(request)
    if state.engine.error is not None or state.engine.stopping or state.is_draining():
        return JSONResponse({"status": "unavailable", "error": state.engine.error}, status_code=503)
    return JSONResponse({"status": "ok"})


async def _metrics(request: Request) -> Response:
    return Response(_state(request).metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


async def _models(request: Request, state: ServerState) -> Response:
    return JSONResponse({"object": "list", "data": [{
        "id": state.model_name, "object": "model", "created": 0, "owned_by": "servelab",
        "max_model_len": state.max_model_len}]})


async def _completions(request: Request, state: ServerState) -> Response:
    body = parse_json(await request.body())
    check_model(body, state.model_name)
    parsed = parse_completion(body)
    generation = await _start(state, parsed, parsed.prompts, "prompt", "cmpl", "completions")
    if parsed.stream:
        return _sse(completion_chunks(generation, state.model_name))
    await _run_to_end(generation, request)
    return JSONResponse(completion_body(generation, state.model_name, parsed.return_token_ids))


async def _chat_completions(request: Request, state: ServerState) -> Response:
    body = parse_json(await request.body())
    check_model(body, state.model_name)
    parsed = parse_chat(body)
    if state.tokenizer is None:
        raise bad_request("this checkpoint has no tokenizer.json, so it cannot take chat messages", "messages")
    try:
        rendered = state.chat_template.render(list(parsed.messages))
    except RequestError as exc:
        raise bad_request(str(exc), "messages") from None
    prompt = state.tokenizer.encode(rendered.text, add_special_tokens=rendered.add_special_tokens)
    generation = await _start(state, parsed, [prompt], "messages", "chatcmpl", "chat.completions")
    if parsed.stream:
        return _sse(chat_chunks(generation, state.model_name))
    await _run_to_end(generation, request)
    return JSONResponse(chat_body(generation, state.model_name, parsed.return_token_ids))


async def _start(state: ServerState, parsed: GenerationRequest, prompts: list[Any], prompt_field: str,
                 id_prefix: str, endpoint: str) -> Generation:
    """Admission control, then queue every choice; 400 / 429 / 503 as ApiError."""
    arrival_time = state.engine.engine.clock()
    num_seqs = len(prompts) * parsed.n
    if num_seqs > state.max_waiting:
        raise bad_request(f"n x prompts = {num_seqs} sequences, more than this server queues at once "
                          f"({state.max_waiting})", "n")
    if state.engine.num_waiting + num_seqs > state.max_waiting:
        raise ApiError(429, f"the server is overloaded: {state.engine.num_waiting} sequences are waiting "
                            f"(limit {state.max_waiting}); retry later", type="rate_limit_error",
                       code="overloaded", headers={"Retry-After": "1"})
    generation = Generation(state.engine, state.tokenizer, prompts, parsed.params, parsed.n,
                            f"{id_prefix}-{uuid.uuid4().hex}", endpoint)
    try:
        await generation.start(arrival_time)
    except RequestError as exc:
        raise request_error(exc, prompt_field) from None
    except EngineUnavailable as exc:
        raise ApiError(503, f"the server cannot take requests: {exc}", type="server_error",
                       code="unavailable", headers={"Retry-After": "5"}) from None
    return generation


async def _run_to_end(generation: Generation, request: Request) -> None:
    """Run a non-streaming request; a client that disconnects first aborts it."""

    async def consume() -> None:
        async for _ in generation.deltas():
            pass

    work = asyncio.ensure_future(consume())
    watch = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()  # its generator's finally aborts the engine requests
            with contextlib.suppress(asyncio.CancelledError):
                await work
    if work.cancelled():
        raise ApiError(499, "the client closed the request")
    try:
        work.result()
    except EngineFailure as exc:
        raise ApiError(500, str(exc), type="server_error") from None


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(chunks: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    async def events() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n"
        except EngineFailure as exc:
            error = ApiError(500, str(exc), type="server_error").body()
            yield f"data: {json.dumps(error)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers=_SSE_HEADERS)

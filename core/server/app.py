"""The ASGI application (Starlette): OpenAI-compatible routes over the engine loop.

    POST /v1/completions        POST /v1/chat/completions      GET /v1/models
    POST /tokenize              POST /detokenize               GET /version
    GET  /tokenizer_info        GET  /health                   GET /ready
    GET  /metrics               GET|POST /ping
    POST /v1/load_lora_adapter  POST /v1/unload_lora_adapter   (with --allow-runtime-lora-updating)

`/v1/*`, `/tokenize`, `/detokenize` and `/tokenizer_info` require `Authorization: Bearer
<key>` when the server has an API key; `/health`, `/ready`, `/ping`, `/version` and
`/metrics` never do. Errors are OpenAI-shaped JSON bodies (see protocol.py), unknown
paths and methods included. A request's body is read within the limits of limits.py, its
prompts are encoded on the codec's pool, and whatever fails on its way fails it alone:
4xx for what the client sent, 5xx naming the cause for the server's own faults.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable

import attrs
import structlog
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from servelab.errors import OverloadedError, RequestError
from servelab.server.codec import CodecFailure, TextCodec
from servelab.server.engine_loop import AdmissionFailed, AsyncEngine, EngineUnavailable
from servelab.errors import NO_NEXT_TOKEN
from servelab.server.generation import EngineFailure, Generation, RequestFailed
from servelab.server.limits import RequestLimits, parse_body, read_body
from servelab.server.lora import LoRAModules
from servelab.server.metrics import ServerMetrics
from servelab.server.protocol import (ApiError, GenerationRequest, PromptBounds, bad_request, check_model,
                                      check_response_size, parse_chat, parse_completion, request_error)
from servelab.server.responses import chat_body, chat_chunks, completion_body, completion_chunks

logger = structlog.get_logger(__name__)
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_REJECT_REASONS = {400: "invalid", 401: "unauthorized", 404: "not_found", 408: "timeout", 413: "too_large",
                   429: "overloaded", 499: "client_closed", 500: "error", 503: "unavailable"}


@attrs.define
class ServerState:
    """Everything the routes share."""

    engine: AsyncEngine  # or a ReplicaSet (replica_set.py), which has the same interface
    metrics: ServerMetrics
    codec: TextCodec
    model_name: str
    max_model_len: int
    max_waiting: int
    api_key: str | None = None
    limits: RequestLimits = attrs.field(factory=RequestLimits)
    draining: bool = False  # set on SIGTERM: admission stops, in-flight requests finish
    liveness_timeout: float = 30.0  # /health is 503 once the engine's loop is not heard from this long with work queued
    stop_ray: bool = False  # the replicas run on a local Ray started by this server
    trust_request_chat_template: bool = False  # render a request's own chat_template (else 400)
    stream_interval: int = 1  # tokens per stream chunk
    lora: LoRAModules | None = None  # the LoRA adapters served (`model` names one), when the engine serves them

    @property
    def bounds(self) -> PromptBounds:
        info = self.engine.info
        return PromptBounds(self.max_model_len, self.limits.prompt_chars(self.max_model_len), info.vocab_size,
                            info.max_logprobs, self.limits.caps)


def build_app(state: ServerState) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        state.engine.start()
        try:
            yield
        finally:
            await state.engine.shutdown()
            state.codec.close()

    routes = [
        Route("/health", _health, methods=["GET"]),
        Route("/ready", _ready, methods=["GET"]),
        Route("/metrics", _metrics, methods=["GET"]),
        Route("/ping", _ping, methods=["GET", "POST"]),
        Route("/version", _version, methods=["GET"]),
        Route("/tokenize", _guarded(_tokenize), methods=["POST"]),
        Route("/tokenizer_info", _guarded(_tokenizer_info), methods=["GET"]),
        Route("/detokenize", _guarded(_detokenize), methods=["POST"]),
        Route("/v1/models", _guarded(_models), methods=["GET"]),
        Route("/v1/completions", _guarded(_completions), methods=["POST"]),
        Route("/v1/chat/completions", _guarded(_chat_completions), methods=["POST"]),
    ]
    if state.lora is not None and state.lora.runtime_updates:
        routes += [Route("/v1/load_lora_adapter", _guarded(_load_lora_adapter), methods=["POST"]),
                   Route("/v1/unload_lora_adapter", _guarded(_unload_lora_adapter), methods=["POST"])]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={HTTPException: _http_error, Exception: _internal_error})
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
            if state.draining:
                raise ApiError(503, "the server is shutting down", type="server_error", code="shutting_down",
                               headers={"Retry-After": "5"})
            return await handler(request, state)
        except ApiError as exc:
            state.metrics.reject(_REJECT_REASONS.get(exc.status, str(exc.status)))
            return error_response(exc)

    return endpoint


def error_response(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's own errors (no such path, wrong method) in the OpenAI shape."""
    message = {404: f"no route for {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
    error = ApiError(exc.status_code, message.get(exc.status_code, str(exc.detail)), code="not_found"
                     if exc.status_code == 404 else None, headers=dict(exc.headers or {}))
    return error_response(error)


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    return error_response(ApiError(500, f"internal server error: {type(exc).__name__}", type="server_error"))


def _check_api_key(request: Request, api_key: str | None) -> None:
    if api_key is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), api_key.encode()):
        raise ApiError(401, "invalid or missing API key: send Authorization: Bearer <key>",
                       code="invalid_api_key")


def _liveness(state: ServerState) -> str | None:
    """Why the server is not live (None: it is): shutting down, the engine failed, or the
    engine's step loop has not turned for liveness_timeout seconds while work is queued."""
    engine = state.engine
    if engine.error is not None:
        return engine.error
    if engine.stopping or state.draining:
        return "shutting down"
    stalled = engine.stalled_seconds()
    if stalled > state.liveness_timeout:
        return (f"the engine's step loop has not turned for {stalled:.1f} s while requests wait "
                f"(liveness timeout {state.liveness_timeout:g} s)")
    return None


async def _health(request: Request) -> Response:
    """Liveness: 503 when the server should be restarted (or is going away)."""
    problem = _liveness(_state(request))
    if problem is not None:
        return JSONResponse({"status": "unavailable", "error": problem}, status_code=503)
    return JSONResponse({"status": "ok"})


async def _ready(request: Request) -> Response:
    """Readiness: 200 when a new request would be taken now (live, and the queue has room)."""
    state = _state(request)
    problem = _liveness(state)
    if problem is None and state.engine.num_waiting >= state.max_waiting:
        problem = f"the queue is full: {state.engine.num_waiting} sequences wait (limit {state.max_waiting})"
    if problem is not None:
        return JSONResponse({"status": "not_ready", "error": problem}, status_code=503)
    return JSONResponse({"status": "ready"})


async def _ping(request: Request) -> Response:
    """vLLM's (and SageMaker's) liveness probe: 200 while live, 503 otherwise."""
    problem = _liveness(_state(request))
    return Response(status_code=200 if problem is None else 503)


async def _version(request: Request) -> Response:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return JSONResponse({"version": version("servelab")})
    except PackageNotFoundError:
        return JSONResponse({"version": "unknown"})


async def _tokenize(request: Request, state: ServerState) -> Response:
    """vLLM's /tokenize: a prompt, or chat messages rendered with the chat template."""
    from servelab.server.tokenize import parse_tokenize

    body = await _body(request, state)
    asked = parse_tokenize(body, state.bounds)
    if state.codec.tokenizer is None:
        raise bad_request("this checkpoint has no tokenizer.json", "prompt" if asked.messages is None else "messages")
    if asked.messages is not None:
        _check_chat_template(state, asked.chat_template)
        rendered = await _encoded(state.codec.render_chat(asked.messages, asked.chat_template), "messages")
        text, special = rendered.text, rendered.add_special_tokens and asked.add_special_tokens
        if len(text) > state.bounds.max_prompt_chars:  # a template may add much to each message
            raise bad_request(f"messages: the rendered chat has {len(text)} characters, more than this server "
                              f"tokenizes ({state.bounds.max_prompt_chars})", "messages")
    else:
        text, special = asked.prompt, asked.add_special_tokens
    tokenizer = state.codec.tokenizer
    tokens = await _encoded(state.codec.run(lambda: tokenizer.encode_batch([text], add_special_tokens=special)[0]),
                            "prompt")
    answer = {"count": len(tokens), "max_model_len": state.max_model_len, "tokens": tokens, "token_strs": None}
    if asked.return_token_strs:
        backend = tokenizer.backend  # the vocabulary's own token strings, as transformers' convert_ids_to_tokens
        answer["token_strs"] = await state.codec.run(lambda: [backend.id_to_token(t) for t in tokens])
    return JSONResponse(answer)


async def _tokenizer_info(request: Request, state: ServerState) -> Response:
    """vLLM's /tokenizer_info: the special tokens, the chat template, the context length
    (what a client needs to tokenize for itself through /tokenize)."""
    template = state.codec.chat_template
    return JSONResponse({"tokenizer_class": "PreTrainedTokenizerFast", **template.special_tokens,
                         "chat_template": template.source, "model_max_length": state.max_model_len})


async def _detokenize(request: Request, state: ServerState) -> Response:
    """vLLM's /detokenize: token ids -> text."""
    from servelab.server.tokenize import parse_detokenize

    body = await _body(request, state)
    tokens = parse_detokenize(body, state.bounds)
    if state.codec.tokenizer is None:
        raise bad_request("this checkpoint has no tokenizer.json", "tokens")
    [text] = await state.codec.decode_prompts([tokens])
    return JSONResponse({"prompt": text})


async def _metrics(request: Request) -> Response:
    return Response(_state(request).metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


async def _models(request: Request, state: ServerState) -> Response:
    adapters = [{"id": adapter.lora_name, "object": "model", "created": 0, "owned_by": "servelab",
                 "root": adapter.lora_path, "parent": state.model_name, "max_model_len": state.max_model_len}
                for adapter in (state.lora.names() if state.lora is not None else [])]
    return JSONResponse({"object": "list", "data": [{
        "id": state.model_name, "object": "model", "created": 0, "owned_by": "servelab", "root": state.model_name,
        "parent": None, "max_model_len": state.max_model_len}, *adapters]})


async def _load_lora_adapter(request: Request, state: ServerState) -> Response:
    body = parse_body(await read_body(request.stream(), request.headers.get("content-length"), state.limits),
                      state.limits)
    adapter = await asyncio.to_thread(state.lora.load, body.get("lora_name"), body.get("lora_path"))
    logger.info("lora.loaded", name=adapter.lora_name, lora_id=adapter.lora_int_id, path=adapter.lora_path)
    return Response(f"Success: LoRA adapter '{adapter.lora_name}' added successfully.", media_type="text/plain")


async def _unload_lora_adapter(request: Request, state: ServerState) -> Response:
    body = parse_body(await read_body(request.stream(), request.headers.get("content-length"), state.limits),
                      state.limits)
    state.lora.unload(body.get("lora_name"))
    logger.info("lora.unloaded", name=body.get("lora_name"))
    return Response(f"Success: LoRA adapter '{body.get('lora_name')}' removed successfully.", media_type="text/plain")


def _adapter_of(body: dict[str, Any], state: ServerState) -> Any:
    """The LoRA adapter the body's `model` names (None: the base model); 404 for a name
    that is neither."""
    model = body.get("model")
    adapter = state.lora.resolve(model) if state.lora is not None and isinstance(model, str) else None
    if adapter is None:
        check_model(body, state.model_name)
    return adapter


async def _body(request: Request, state: ServerState) -> dict[str, Any]:
    raw = await read_body(request.stream(), request.headers.get("content-length"), state.limits)
    # parsing and checking every value is proportional to the body: on a thread, not the event loop
    body = parse_body(raw, state.limits) if len(raw) < _INLINE_BYTES else await asyncio.to_thread(
        parse_body, raw, state.limits)
    return body


async def _encoded(encode: Awaitable[Any], field: str) -> Any:
    """Prompts encoded on the codec's pool: RequestError -> 400, CodecFailure -> 500."""
    try:
        return await encode
    except RequestError as exc:
        raise request_error(exc, field) from None
    except CodecFailure as exc:
        raise ApiError(500, f"tokenizing the {field} failed: {exc}", field, type="server_error") from None


def _check_context(prompts: list[list[int]], parsed: GenerationRequest, state: ServerState,
                   field: str) -> list[int]:
    """Each prompt's max_tokens, clipped to the room its context leaves (as vLLM 0.3x
    does: the output then ends with finish_reason "length"); 400 for an empty prompt or one
    that leaves no room at all."""
    limits = []
    for prompt in prompts:
        if not prompt:
            raise bad_request(f"{field} is empty: it has no tokens, and a model needs at least one to continue",
                              field)
        if len(prompt) >= state.max_model_len:
            raise bad_request(f"{field} has {len(prompt)} tokens; max_model_len={state.max_model_len} leaves no room "
                              f"for a token after it", field)
        room = state.max_model_len - len(prompt)
        if parsed.params.min_tokens > room:
            raise bad_request(f"min_tokens is {parsed.params.min_tokens}, but {field} has {len(prompt)} tokens and "
                              f"max_model_len={state.max_model_len} leaves room for {room}", "min_tokens")
        limits.append(min(parsed.params.max_tokens, room))
    check_response_size([len(prompt) for prompt in prompts], parsed, state.bounds)
    return limits


def _check_chat_template(state: ServerState, source: str | None) -> None:
    """400 for a request's own template unless the server trusts them, and for chat
    without any template."""
    if source is not None and not state.trust_request_chat_template:
        raise bad_request("chat_template in a request is refused: a template is code the server runs; start the "
                          "server with --trust-request-chat-template to allow it", "chat_template",
                          "untrusted_chat_template")
    if source is None and state.codec.chat_template.is_missing:
        raise bad_request("this model has no chat template (no chat_template.jinja, and no chat_template in its "
                          "tokenizer_config.json), so it cannot take chat messages: start the server with "
                          "--chat-template FILE (or --chat-template plain), or use /v1/completions", "messages",
                          "chat_template_missing")


async def _completions(request: Request, state: ServerState) -> Response:
    arrival_time = state.engine.clock()  # TTFT counts the tokenization too
    body = await _body(request, state)
    adapter = _adapter_of(body, state)
    parsed = parse_completion(body, state.bounds)
    prompts = await _encoded(state.codec.encode_prompts(parsed.prompts), "prompt")
    limits = _check_context(prompts, parsed, state, "prompt")
    generation = await _start(request, state, parsed, prompts, "prompt", "cmpl", "completions", arrival_time,
                              limits, adapter)
    model = adapter.lora_name if adapter is not None else state.model_name
    if parsed.stream:
        return _sse(completion_chunks(generation, model, parsed), parsed.structured_field)
    await _run_to_end(generation, request, parsed.structured_field)
    return await _json(completion_body(generation, model, parsed))


async def _chat_completions(request: Request, state: ServerState) -> Response:
    arrival_time = state.engine.clock()
    body = await _body(request, state)
    adapter = _adapter_of(body, state)
    parsed = parse_chat(body, state.bounds)
    _check_chat_template(state, parsed.chat_template)
    prompt = await _encoded(state.codec.encode_chat(list(parsed.messages), state.bounds.max_prompt_chars,
                                                    parsed.chat_template, parsed.chat_template_kwargs),
                            "messages")
    limits = _check_context([prompt], parsed, state, "messages")
    generation = await _start(request, state, parsed, [prompt], "messages", "chatcmpl", "chat.completions",
                              arrival_time, limits, adapter)
    model = adapter.lora_name if adapter is not None else state.model_name
    if parsed.stream:
        return _sse(chat_chunks(generation, model, parsed), parsed.structured_field)
    await _run_to_end(generation, request, parsed.structured_field)
    return await _json(chat_body(generation, model, parsed))


async def _start(request: Request, state: ServerState, parsed: GenerationRequest, prompts: list[Any],
                 prompt_field: str, id_prefix: str, endpoint: str, arrival_time: float,
                 max_tokens: list[int] | None = None, lora_request: Any = None) -> Generation:
    """Admission control, then queue every choice; 400 / 429 / 500 / 503 as ApiError."""
    if state.draining:  # it began before the signal and was tokenized since
        raise ApiError(503, "the server is shutting down", type="server_error", code="shutting_down",
                       headers={"Retry-After": "5"})
    num_seqs = len(prompts) * parsed.n
    if num_seqs > state.max_waiting:
        raise bad_request(f"n x prompts = {num_seqs} sequences, more than this server queues at once "
                          f"({state.max_waiting})", "n")
    if state.engine.num_waiting + num_seqs > state.max_waiting:
        raise ApiError(429, f"the server is overloaded: {state.engine.num_waiting} sequences are waiting "
                            f"(limit {state.max_waiting}); retry later", type="rate_limit_error",
                       code="overloaded", headers={"Retry-After": "1"})
    echo_texts = None
    if parsed.echo:  # the prompt as given, or its token ids decoded (on the codec's pool)
        echo_texts = await state.codec.decode_prompts(parsed.prompts)
    generation = Generation(state.engine, state.codec.tokenizer, prompts, parsed.params, parsed.n,
                            f"{id_prefix}-{uuid.uuid4().hex}", endpoint, echo_texts, max_tokens,
                            parsed.scoring_only, state.stream_interval, lora_request)
    try:
        # a client that leaves while its request is validated or its grammar compiles
        # cancels it there (the compilation stops once no request waits for it)
        await _unless_disconnected(request, generation.start(arrival_time))
    except OverloadedError as exc:
        raise ApiError(429, str(exc), parsed.structured_field, type="rate_limit_error", code="overloaded",
                       headers={"Retry-After": "1"}) from None
    except RequestError as exc:
        raise request_error(exc, prompt_field, parsed.structured_field) from None
    except AdmissionFailed as exc:
        raise ApiError(500, f"the engine could not take the request in: {exc}", type="server_error") from None
    except EngineUnavailable as exc:
        raise ApiError(503, f"the server cannot take requests: {exc}", type="server_error",
                       code="unavailable", headers={"Retry-After": "5"}) from None
    return generation


async def _run_to_end(generation: Generation, request: Request, structured_field: str | None) -> None:
    """Run a non-streaming request; a client that disconnects first aborts it."""

    async def consume() -> None:
        async for _ in generation.deltas():
            pass

    try:
        await _unless_disconnected(request, consume())  # its generator's finally aborts the engine requests
    except (EngineFailure, CodecFailure) as exc:
        raise _failure(exc, structured_field) from None


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """`work`'s result, or ApiError 499 once the client disconnects first (`work` cancelled)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise ApiError(499, "the client closed the request")
    return task.result()


def _failure(exc: Exception, structured_field: str | None) -> ApiError:
    """A request that failed after it started: the client's grammar reaching a dead end is
    a 400 on its field (code "grammar_dead_end"); anything else is the server's 500."""
    if isinstance(exc, RequestFailed) and NO_NEXT_TOKEN in str(exc):
        return ApiError(400, f"{exc}: no token of the vocabulary continues the output within its constraint",
                        structured_field, code="grammar_dead_end")
    return ApiError(500, str(exc), type="server_error")


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(chunks: AsyncIterator[dict[str, Any]], structured_field: str | None = None) -> StreamingResponse:
    async def events() -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                yield b"data: " + dump_json(chunk) + b"\n\n"
        except (EngineFailure, CodecFailure) as exc:
            error = _failure(exc, structured_field).body()
            yield b"data: " + dump_json(error) + b"\n\n"
        except Exception as exc:  # the stream has begun: the error can only be an event
            logger.exception("stream.failed")
            error = ApiError(500, f"internal server error: {type(exc).__name__}", type="server_error").body()
            yield b"data: " + dump_json(error) + b"\n\n"
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers=_SSE_HEADERS)


_INLINE_BYTES = 64 * 1024  # bodies and responses smaller than this are handled on the event loop


async def _json(body: dict[str, Any]) -> Response:
    """A JSON response, encoded on a thread when it is large (echo with logprobs)."""
    encoded = dump_json(body) if _small(body) else await asyncio.to_thread(dump_json, body)
    return Response(encoded, media_type="application/json")


def _small(body: dict[str, Any]) -> bool:
    choices = body.get("choices", ())
    return len(choices) <= 4 and all(not choice.get("logprobs") for choice in choices)


def _dump_json_stdlib(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


try:  # a stream's chunks are encoded once per token and stream: orjson is several times faster
    import orjson

    def dump_json(value: Any) -> bytes:
        try:
            return orjson.dumps(value)
        except orjson.JSONEncodeError:  # what orjson refuses (a lone surrogate) the stdlib escapes
            return _dump_json_stdlib(value)
except ImportError:
    dump_json = _dump_json_stdlib

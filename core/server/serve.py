"""`servelab serve`: build the engine, bind the socket, run uvicorn until a signal.

SIGINT or SIGTERM starts a graceful shutdown: admission stops (every new request, on a
new connection or an open one, gets 503 with Retry-After, and /health 503), in-flight
requests run to completion for up to `shutdown_timeout` seconds, then whatever is left
is aborted: each open stream ends with a final chunk whose finish_reason is "abort",
its usage and [DONE]. Then the socket closes, the engine process stops and the process
exits 0. A second signal skips the wait.

The engine runs in a process of its own (engine_process.py); this process serves HTTP,
tokenizes and detokenizes.

If the engine itself fails (an exception out of a step, or out of the loop around it),
every request in flight ends with an error (a stream: an error event, then [DONE]),
/health answers 503, and the process exits with EXIT_ENGINE_FAILED so that a supervisor
restarts it: a failed engine's state cannot be trusted, so it is not restarted in place.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
import time
from typing import Any, Callable, Iterator

import attrs
import structlog

from servelab.config import EngineConfig
from servelab.errors import ServelabError
from servelab.server.limits import RequestLimits
from servelab.server.liveness import HEARTBEAT_SECONDS, POLL_SECONDS, minimum_liveness_timeout

logger = structlog.get_logger(__name__)
_SIGNALS = (signal.SIGINT, signal.SIGTERM)
EXIT_ENGINE_FAILED = 1
_FLUSH_SECONDS = 5.0  # after the drain: for the last chunks to reach their clients


@attrs.frozen(kw_only=True)
class ServerOptions:
    """How the HTTP server runs (the engine itself is configured by EngineConfig)."""

    host: str = "127.0.0.1"
    port: int = 8000  # 0 picks a free port; the ready line on stdout says which
    api_key: str | None = None  # required as `Authorization: Bearer <key>` on /v1/* when set
    served_model_name: str | None = None  # the model id clients send; default: the model path
    max_waiting: int = 256  # queued sequences beyond which requests get 429 + Retry-After
    shutdown_timeout: float = 10.0  # seconds in-flight requests get to finish on shutdown
    header_timeout: float = 10.0  # seconds a connection gets to send a request's headers
    limits: RequestLimits = attrs.field(factory=RequestLimits)  # body size and time, JSON depth, prompt size
    tokenizer_workers: int = 2  # threads that tokenize prompts and render chat templates
    engine_threads: int | None = None  # torch threads of the engine process; None: every core
    replicas: int | None = None  # run this many engine replicas as Ray actors (None: one engine process)
    ray_address: str | None = None  # the Ray cluster to join; None: start a local Ray for the replicas
    # prefill and decode replicas as Ray actors, the KV handed over (docs/disaggregation.md); None: not disaggregated
    prefill_replicas: int | None = None
    decode_replicas: int | None = None
    kv_failure_policy: str = "recompute"  # a request whose prefill replica or handoff was lost: fail or recompute
    kv_lease_s: float = 30.0  # how long a prefill replica holds a request's KV blocks for its decode replica
    liveness_timeout: float = 30.0  # /health: 503 once the engine's loop is silent this long with work queued
    chat_template: str | None = None  # a template file, its text, or "plain"; None: the checkpoint's own
    trust_request_chat_template: bool = False  # render a `chat_template` a request sends (else a 400)
    stream_interval: int = 1  # tokens per stream chunk (vLLM's --stream-interval)
    # LoRA adapters (docs/lora.md): (name, path) served as OpenAI models named `name`; loading
    # and unloading at run time (/v1/load_lora_adapter, /v1/unload_lora_adapter) only with
    # `allow_runtime_lora_updating`, within max_lora_adapters adapters of max_lora_bytes each.
    lora_modules: tuple[tuple[str, str], ...] = ()
    allow_runtime_lora_updating: bool = False
    max_lora_adapters: int = 64
    max_lora_bytes: int = 256 * 2**20

    def __attrs_post_init__(self) -> None:
        positive = {"--max-waiting": self.max_waiting, "--header-timeout": self.header_timeout,
                    "--body-timeout": self.limits.body_timeout, "--max-body-bytes": self.limits.max_body_bytes,
                    "--max-json-depth": self.limits.max_json_depth, "--tokenizer-workers": self.tokenizer_workers,
                    "--liveness-timeout": self.liveness_timeout, "--stream-interval": self.stream_interval,
                    "--max-lora-adapters": self.max_lora_adapters, "--max-lora-bytes": self.max_lora_bytes}
        if self.engine_threads is not None:
            positive["--engine-threads"] = self.engine_threads
        disaggregated = self.prefill_replicas is not None or self.decode_replicas is not None
        if disaggregated:
            if self.prefill_replicas is None or self.decode_replicas is None:
                raise ServelabError("give both --prefill-replicas N and --decode-replicas M")
            if self.replicas is not None:
                raise ServelabError("--replicas runs colocated replicas: it does not go with --prefill-replicas and "
                                    "--decode-replicas")
            positive["--prefill-replicas"] = self.prefill_replicas
            positive["--decode-replicas"] = self.decode_replicas
            positive["--kv-lease-s"] = self.kv_lease_s
            if self.kv_failure_policy not in ("fail", "recompute"):
                raise ServelabError(f"--kv-failure-policy must be fail or recompute, got {self.kv_failure_policy!r}")
        if self.replicas is not None:
            positive["--replicas"] = self.replicas
        elif self.ray_address is not None and not disaggregated:
            raise ServelabError("--ray-address is for replicas: give --replicas N (or --prefill-replicas and "
                                "--decode-replicas) too")
        if self.limits.max_prompt_chars is not None:
            positive["--max-prompt-chars"] = self.limits.max_prompt_chars
        for flag, value in positive.items():
            if not value > 0:
                raise ServelabError(f"{flag} must be > 0, got {value}")
        check_liveness_timeout(self.liveness_timeout, disaggregated)
        if self.shutdown_timeout < 0:
            raise ServelabError(f"--shutdown-timeout must be >= 0, got {self.shutdown_timeout}")
        if self.api_key is not None and not self.api_key.strip():
            raise ServelabError("the API key must not be empty (from --api-key, --api-key-file or SERVELAB_API_KEY)")


def check_liveness_timeout(timeout: float, disaggregated: bool) -> None:
    """Refuse a liveness timeout that live engines cannot meet (liveness.py): the watchdogs
    would take healthy engines for stopped ones, and kill prefill and decode replicas."""
    shortest = minimum_liveness_timeout(disaggregated)
    if timeout >= shortest:
        return
    if disaggregated:
        deployment, heard = "prefill and decode replicas", f"each answers its poll every {POLL_SECONDS:g} s"
    else:
        deployment, heard = "an engine", f"it sends a heartbeat every {HEARTBEAT_SECONDS:g} s while it has work"
    raise ServelabError(f"--liveness-timeout must be at least {shortest:g} s for {deployment}, got {timeout:g}: "
                        f"{heard}, and a shorter timeout takes a healthy one for a stopped one")


def run_server(config: EngineConfig, options: ServerOptions) -> int:
    """Serve until SIGINT / SIGTERM; returns the exit code (0 after a graceful shutdown)."""
    try:
        import uvicorn
    except ImportError:
        raise ServelabError("`servelab serve` needs the serve extra: pip install 'servelab[serve]'") from None
    from servelab.server.app import build_app

    sock = _bind(options.host, options.port)  # a taken port fails before the slow model load
    try:
        state = _build_state(config, options)
    except BaseException:
        sock.close()
        raise
    from servelab.server.connection import protocol_with_header_timeout

    uvicorn_config = uvicorn.Config(build_app(state), log_config=None, access_log=False, lifespan="on",
                                    http=protocol_with_header_timeout(options.header_timeout),
                                    timeout_graceful_shutdown=_FLUSH_SECONDS)
    host, port = sock.getsockname()[:2]

    def ready() -> None:
        print(f"servelab: serving {state.model_name!r} on http://{_url_host(host)}:{port}", flush=True)
        logger.info("server.started", model=state.model_name, host=host, port=port,
                    api_key=options.api_key is not None, max_waiting=options.max_waiting,
                    chat_template=state.codec.chat_template.kind)

    server = _graceful_server(uvicorn_config, state, options.shutdown_timeout, ready)
    state.engine.on_failure = server.engine_failed
    try:
        server.run(sockets=[sock])
    finally:
        if state.stop_ray:
            from servelab.server.replicas import import_ray

            import_ray().shutdown()
    logger.info("server.stopped", model=state.model_name, exit_code=server.exit_code,
                kv_blocks_used=state.engine.snapshot.allocator.num_used_blocks)
    return server.exit_code


def _build_state(config: EngineConfig, options: ServerOptions) -> Any:
    """The engine process (its model loaded), the front end's tokenizer, and everything the routes share."""
    from prometheus_client import disable_created_metrics

    from servelab.kv_sizing import DTYPE_BYTES
    from servelab.model.loader import Checkpoint
    from servelab.server.app import ServerState
    from servelab.server.codec import TextCodec
    from servelab.server.engine_loop import AsyncEngine
    from servelab.server.engine_process import ProcessConnection
    from servelab.server.metrics import ServerMetrics

    disable_created_metrics()  # process-wide: no `_created` series next to every counter
    metrics = ServerMetrics(options.served_model_name or config.engine.model)
    checkpoint = Checkpoint.open(config.engine.model)  # config and tokenizer only: the weights stay in the engine
    if options.lora_modules or options.allow_runtime_lora_updating:
        config = config.with_overrides({"engine.enable_lora": True})
    lora = lora_modules(config, options, checkpoint.config)  # a bad adapter stops the start before the engine
    metrics.kv_bytes_per_token.labels(config.engine.kv_cache_dtype).set(checkpoint.config.kv_bytes_per_token(
        DTYPE_BYTES[config.engine.dtype], config.engine.kv_cache_dtype))
    codec = TextCodec(checkpoint.tokenizer, chat_template(checkpoint.tokenizer, options.chat_template,
                                                          config.engine.model.startswith("builtin:")),
                      options.tokenizer_workers)
    stop_ray = False
    if options.prefill_replicas is not None:
        from servelab.server.disaggregated import launch_disaggregated

        threads = options.engine_threads
        if threads is None and options.ray_address is None:  # a local Ray: the cores shared out
            threads = max(1, default_engine_threads() // (options.prefill_replicas + options.decode_replicas))
        engine, stop_ray = launch_disaggregated(config, options.prefill_replicas, options.decode_replicas,
                                                options.kv_failure_policy, options.kv_lease_s, options.ray_address,
                                                threads=threads, tokenizer=checkpoint.tokenizer, metrics=metrics,
                                                liveness_timeout=options.liveness_timeout)
    elif options.replicas is not None:
        from servelab.server.replicas import launch_replicas, replica_configs

        threads = options.engine_threads
        if threads is None and options.ray_address is None:  # a local Ray: the cores shared out
            threads = max(1, default_engine_threads() // options.replicas)
        engine, stop_ray = launch_replicas(replica_configs(config, options.replicas), options.ray_address,
                                           threads=threads, metrics=metrics)
        engine.liveness_timeout = options.liveness_timeout  # a silent replica leaves the rotation
    else:  # the engine's own errors (a bad policy name) surface here, as ServelabError
        engine = AsyncEngine(ProcessConnection(config, threads=options.engine_threads or default_engine_threads()),
                             metrics.observe)
    return ServerState(engine=engine, metrics=metrics, codec=codec,
                       model_name=options.served_model_name or config.engine.model,
                       max_model_len=engine.info.max_model_len, max_waiting=options.max_waiting,
                       api_key=options.api_key, limits=options.limits, stop_ray=stop_ray,
                       liveness_timeout=options.liveness_timeout,
                       trust_request_chat_template=options.trust_request_chat_template,
                       stream_interval=options.stream_interval, lora=lora)


def lora_modules(config: EngineConfig, options: ServerOptions, model_config: Any) -> Any:
    """The adapters `--lora-modules` names, each checked against the base model (None where
    the engine serves no LoRA); ServelabError naming the adapter's file and field."""
    if not config.engine.enable_lora:
        return None
    from servelab.server.lora import LoRABounds, LoRAModules
    from servelab.server.protocol import ApiError

    modules = LoRAModules(model_config, LoRABounds(options.max_lora_adapters, options.max_lora_bytes,
                                                   config.engine.max_lora_rank), options.allow_runtime_lora_updating)
    for name, path in options.lora_modules:
        try:
            modules.load(name, path)
        except ApiError as exc:
            raise ServelabError(f"--lora-modules {name}={path}: {exc.message}") from None
    return modules


def default_engine_threads() -> int:
    """Every core, as vLLM's engine: the front end's share of the CPU is small (about 0.1 ms
    a streamed token against several ms of engine time a token on SmolLM2-135M), and on a
    quiet 2-core machine two engine threads served 1.6-1.7x the tokens of one, with TPOT
    at 4 requests/s a third of one thread's (docs/serving.md, "Against vLLM's server").
    On a machine shared with other work, `--engine-threads` fewer than the cores keeps
    torch's threads, which wait for each other at every operation, from being preempted."""
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _graceful_server(config: Any, state: Any, shutdown_timeout: float, on_ready: Callable[[], None]) -> Any:
    """A uvicorn Server that drains on a signal (see the module docstring) and returns, with
    `exit_code` 0, or EXIT_ENGINE_FAILED once the engine has failed. (uvicorn's own server
    closes the socket at once and re-raises the signal afterwards.)"""
    import asyncio

    import uvicorn

    class GracefulServer(uvicorn.Server):
        exit_code = 0
        _loop: Any = None
        _drain: Any = None

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in _SIGNALS}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

        def handle_exit(self, sig: int, frame: Any) -> None:
            if state.draining or self._loop is None:  # a second signal, or one before startup: stop now
                super().handle_exit(sig, frame)
                return
            state.draining = True
            logger.info("server.draining", in_flight=state.engine.num_in_flight, deadline_s=shutdown_timeout)
            self._loop.call_soon_threadsafe(self._start_drain)

        def engine_failed(self, message: str) -> None:
            logger.error("server.engine_failed", error=message, exit_code=EXIT_ENGINE_FAILED)
            self.exit_code = EXIT_ENGINE_FAILED
            state.draining = True
            self.should_exit = True  # the failed requests' error events are already queued

        def _start_drain(self) -> None:
            self._drain = asyncio.ensure_future(self._drain_then_exit())

        async def _drain_then_exit(self) -> None:
            engine = state.engine
            if not await _wait_until(lambda: engine.num_in_flight == 0, shutdown_timeout):
                logger.warning("server.drain_deadline", aborted=engine.num_in_flight)
                engine.abort_all()  # each stream ends with finish_reason "abort" and [DONE]
                await _wait_until(lambda: engine.num_in_flight == 0, _FLUSH_SECONDS)
            self.should_exit = True

        async def startup(self, sockets: Any = None) -> None:
            self._loop = asyncio.get_running_loop()
            await super().startup(sockets=sockets)
            if self.started:
                on_ready()

    return GracefulServer(config)


async def _wait_until(condition: Callable[[], bool], seconds: float) -> bool:
    """Poll `condition` for up to `seconds`; whether it came true."""
    import asyncio

    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.05)
    return True


def chat_template(tokenizer: Any, given: str | None, builtin: bool) -> Any:
    """The server's chat template: `--chat-template` (a file, its text, or "plain"), else the
    checkpoint's own; servelab's built-in models speak the plain format."""
    from pathlib import Path

    from servelab.server.chat import ChatTemplate

    own = ChatTemplate.from_tokenizer(tokenizer)
    if given is None:
        return ChatTemplate.plain_format() if own.is_missing and builtin else own
    if given == "plain":
        return ChatTemplate.plain_format()
    if "{{" in given or "{%" in given:  # the template's text itself
        source = given
    else:
        try:
            source = Path(given).read_text(encoding="utf-8")
        except OSError as exc:
            raise ServelabError(f"--chat-template: cannot read {given!r}: {exc.strerror or exc} (give a jinja file, "
                                f"the template's text, or plain)") from None
    import jinja2

    try:
        return own.with_source(source)
    except jinja2.TemplateError as exc:
        raise ServelabError(f"--chat-template: the template does not compile: {exc}") from None


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ServelabError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock  # uvicorn (asyncio's create_server) starts listening once the app is up


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host

"""`servelab serve`: build the engine, bind the socket, run uvicorn until a signal.

SIGINT or SIGTERM starts a graceful shutdown: the listening socket closes (new
connections are refused), requests on open connections get 503, in-flight requests
run to completion for up to `shutdown_timeout` seconds, then whatever is left is
cancelled (its engine requests aborted), the engine thread stops and the process exits 0.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
from typing import Any, Callable, Iterator

import attrs
import structlog

from servelab.config import EngineConfig
from servelab.errors import ServelabError

logger = structlog.get_logger(__name__)
_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@attrs.frozen(kw_only=True)
class ServerOptions:
    """How the HTTP server runs (the engine itself is configured by EngineConfig)."""

    host: str = "127.0.0.1"
    port: int = 8000  # 0 picks a free port; the ready line on stdout says which
    api_key: str | None = None  # required as `Authorization: Bearer <key>` on /v1/* when set
    served_model_name: str | None = None  # the model id clients send; default: the model path
    max_waiting: int = 256  # queued sequences beyond which requests get 429 + Retry-After
    shutdown_timeout: float = 10.0  # seconds in-flight requests get to finish on shutdown

    def __attrs_post_init__(self) -> None:
        if self.max_waiting < 1:
            raise ServelabError(f"--max-waiting must be >= 1, got {self.max_waiting}")
        if self.shutdown_timeout < 0:
            raise ServelabError(f"--shutdown-timeout must be >= 0, got {self.shutdown_timeout}")
        if self.api_key == "":
            raise ServelabError("--api-key must not be empty")


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
    uvicorn_config = uvicorn.Config(build_app(state), log_config=None, access_log=False, lifespan="on",
                                    timeout_graceful_shutdown=options.shutdown_timeout)
    host, port = sock.getsockname()[:2]

    def ready() -> None:
        print(f"servelab: serving {state.model_name!r} on http://{_url_host(host)}:{port}", flush=True)
        logger.info("server.started", model=state.model_name, host=host, port=port,
                    api_key=options.api_key is not None, max_waiting=options.max_waiting,
                    chat_template="default" if state.chat_template.is_default else "checkpoint")

    server = _graceful_server(uvicorn_config, ready)
    state.is_draining = lambda: server.should_exit
    server.run(sockets=[sock])
    logger.info("server.stopped", model=state.model_name)
    return 0


def _build_state(config: EngineConfig, options: ServerOptions) -> Any:
    """The engine (with the metrics observer registered) and everything the routes share."""
    from prometheus_client import disable_created_metrics

    from servelab.engine import LLMEngine
    from servelab.registry import PluginRegistry
    from servelab.server.app import ServerState
    from servelab.server.engine_loop import AsyncEngine
    from servelab.server.metrics import EngineObserver, ServerMetrics

    disable_created_metrics()  # process-wide: no `_created` series next to every counter
    metrics = ServerMetrics()
    registry = PluginRegistry.from_entry_points()
    registry.register(EngineObserver(metrics), name="servelab-server-metrics")
    engine = LLMEngine(config, registry)
    return ServerState(engine=AsyncEngine(engine, metrics.observe), metrics=metrics,
                       model_name=options.served_model_name or config.engine.model,
                       max_model_len=engine.limits.max_model_len, max_waiting=options.max_waiting,
                       api_key=options.api_key, chat_template=_chat_template(engine))


def _graceful_server(config: Any, on_ready: Callable[[], None]) -> Any:
    """A uvicorn Server whose signals mean: shut down gracefully and return. (uvicorn's
    own re-raises the signal afterwards, which would end the process by that signal.)"""
    import uvicorn

    class GracefulServer(uvicorn.Server):
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

        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets=sockets)
            if self.started:
                on_ready()

    return GracefulServer(config)


def _chat_template(engine: Any) -> Any:
    from servelab.server.chat import ChatTemplate

    path = getattr(getattr(engine, "source", None), "path", None)  # the checkpoint directory, if any
    return ChatTemplate.from_directory(path) if path is not None else ChatTemplate(None)


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

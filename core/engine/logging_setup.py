"""structlog for servelab: the library's loggers, and the configuration its command-line
programs apply.

The library only emits events, through `get_logger`; the application decides where
they go by configuring structlog. Until it does, the library stays quiet below WARNING
(structlog's unconfigured default would print every debug event on stdout).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR, "exception": logging.ERROR, "critical": logging.CRITICAL}


class LibraryLogger:
    """A structlog logger that drops events below WARNING while structlog is unconfigured."""

    def __init__(self, name: str, context: dict[str, Any] | None = None) -> None:
        self._name = name
        self._context = context or {}
        self._logger = structlog.get_logger(name)  # a lazy proxy: follows later configuration

    def bind(self, **values: Any) -> "LibraryLogger":
        return LibraryLogger(self._name, {**self._context, **values})

    def debug(self, event: str, **values: Any) -> None:
        self._emit("debug", event, values)

    def info(self, event: str, **values: Any) -> None:
        self._emit("info", event, values)

    def warning(self, event: str, **values: Any) -> None:
        self._emit("warning", event, values)

    def error(self, event: str, **values: Any) -> None:
        self._emit("error", event, values)

    def exception(self, event: str, **values: Any) -> None:
        self._emit("exception", event, values)

    def critical(self, event: str, **values: Any) -> None:
        self._emit("critical", event, values)

    def _emit(self, level: str, event: str, values: dict[str, Any]) -> None:
        if _LEVELS[level] < logging.WARNING and not structlog.is_configured():
            return
        getattr(self._logger, level)(event, **self._context, **values)


def get_logger(name: str) -> LibraryLogger:
    """The logger a servelab module emits through."""
    return LibraryLogger(name)


_configured_verbosity: int | None = None


def configured_verbosity() -> int | None:
    """The verbosity configure_logging was last given (None before it ran): a process the
    engine starts configures its own logging the same way."""
    return _configured_verbosity


class _CurrentStderr:
    """Writes to sys.stderr as it is at each write. Binding the stream object itself at
    configuration time breaks when it is later replaced and closed (test runners capturing
    output, daemonised servers): every later event would raise instead of being written."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(verbosity: int = 0) -> None:
    """Human-readable events on stderr: warnings by default, info with -v, debug with -vv."""
    global _configured_verbosity
    _configured_verbosity = verbosity
    level = {0: logging.WARNING, 1: logging.INFO}.get(verbosity, logging.DEBUG)
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="%H:%M:%S"),
            structlog.dev.ConsoleRenderer(colors=False),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=_CurrentStderr()),
        cache_logger_on_first_use=True,
    )

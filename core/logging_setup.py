"""structlog configuration for servelab's command-line programs. The library itself
only emits events; applications (the CLI, your script) decide where they go."""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(verbosity: int = 0) -> None:
    """Human-readable events on stderr: warnings by default, info with -v, debug with -vv."""
    level = {0: logging.WARNING, 1: logging.INFO}.get(verbosity, logging.DEBUG)
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="%H:%M:%S"),
            structlog.dev.ConsoleRenderer(colors=False),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )

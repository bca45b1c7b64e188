"""Exceptions servelab raises for bad input. Each message names the offending thing."""

import signal


class ServelabError(Exception):
    """Base class of every error servelab raises on purpose."""


class ConfigError(ServelabError, ValueError):
    """A config file, dict or override is invalid (the message names the key)."""


class PluginError(ServelabError):
    """A plugin is unknown, duplicated, or failed to load."""


class CheckpointError(ServelabError):
    """A checkpoint directory is missing files or holds an unsupported architecture."""


class RequestError(ServelabError, ValueError):
    """A request is invalid (prompt too long, bad sampling parameters)."""


class DistributedError(ServelabError):
    """A tensor-parallel rank died, hung or failed to start (the message names the rank)."""


class OverloadedError(RequestError):
    """A request that is valid but cannot be taken now (a bounded queue is full); retry later."""


# The message with which the structured-output processor fails a row whose grammar allows
# no next token; the server answers it with code "grammar_dead_end".
NO_NEXT_TOKEN = "the grammar allows no next token"


class PolicyViolation(ServelabError):
    """A policy broke an invariant the engine relies on (the message names it), caught
    before it could corrupt state: `invariant violated: <name>: <detail>`."""

    def __init__(self, invariant: str, detail: str = "") -> None:
        self.invariant = invariant
        super().__init__(f"invariant violated: {invariant}" + (f": {detail}" if detail else ""))


def exit_status(code: int | None) -> str:
    """How a child process ended, for the errors that name it: "killed by SIGKILL",
    "exit code 1", ... from its return code (None: still running)."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"

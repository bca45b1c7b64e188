"""How the front end reaches an engine core: one interface, wherever the core runs.

An `EngineConnection` carries commands to an `EngineCore` (engine_core.py) and hands
each of its `CoreOutput`s to a callback, on a thread of the connection's own. Three
kinds sit behind it: `ThreadConnection` (the core on a thread of this process: tests and
the Python API), `ProcessConnection` (engine_process.py: the core in a process of its
own, what `servelab serve` runs) and `RayActorConnection` (replicas.py: the core in a
Ray actor). `AsyncEngine` (engine_loop.py) is the same front end for all three.
"""

from __future__ import annotations

import functools
import queue
import threading
from typing import Any, Callable, Protocol

from servelab.server.engine_core import Command, CoreOutput, EngineCore, EngineInfo

OnOutput = Callable[[CoreOutput], None]
OnExit = Callable[[str], None]  # the core went away without a word (its process or actor died)


class EngineConnection(Protocol):
    info: EngineInfo

    def clock(self) -> float:
        """The engine's clock, for NewRequest.arrival_time."""

    def start(self, on_output: OnOutput, on_exit: OnExit) -> None:
        """Start delivering the core's outputs (on a thread of the connection's)."""

    def send(self, command: Command) -> None:
        """Queue a command; never blocks on the engine."""

    def stop(self, timeout: float) -> None:
        """Send "stop", wait for the core's last output and for it to end (blocking)."""


class ThreadConnection:
    """The core on a thread of this process, reached through a queue."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    @functools.cached_property
    def info(self) -> EngineInfo:
        return EngineInfo.of(self.engine)

    def clock(self) -> float:
        return self.engine.clock()

    def start(self, on_output: OnOutput, on_exit: OnExit) -> None:
        core = EngineCore(self.engine, self._receive, on_output)
        self._thread = threading.Thread(target=core.run, name="servelab-engine", daemon=True)
        self._thread.start()

    def send(self, command: Command) -> None:
        self._commands.put(command)

    def stop(self, timeout: float) -> None:
        self._commands.put(("stop", None, None))
        if self._thread is not None:
            self._thread.join(timeout)

    def _receive(self, block: bool) -> list[Command]:
        return take_commands(self._commands, block)


def take_commands(commands: queue.Queue | queue.SimpleQueue, block: bool) -> list[Command]:
    """Every command waiting in `commands`; with `block`, at least one (waiting for it)."""
    taken = [commands.get()] if block else []
    while True:
        try:
            taken.append(commands.get_nowait())
        except queue.Empty:
            return taken

"""The engine core in a process of its own (as vLLM splits AsyncLLM from EngineCore).

The server's process does HTTP, validation, tokenization and detokenization; this one
loads the model and runs schedule -> forward -> sample, and nothing else, so neither
waits for the other's share of the GIL. Commands go down one pipe, and each step's
`CoreOutput` (every sequence's new token ids at once) comes back up another, read by a
thread of the server's.

The engine process ignores SIGINT and SIGTERM: the server decides when the engine
stops (after its graceful drain) and sends "stop". If the server's process dies, the
command pipe closes and the engine process stops by itself. If the engine process dies
(killed, out of memory, a crash in native code), its output pipe closes and the server
fails every request in flight with a message naming the exit status.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from typing import Any

import structlog

from servelab.errors import ServelabError, exit_status
from servelab.server.engine_connection import OnExit, OnOutput
from servelab.server.engine_core import Command, EngineCore, EngineInfo

logger = structlog.get_logger(__name__)
_START_TIMEOUT = 600.0  # seconds a model load may take


class ProcessConnection:
    """Starts an engine process for `config` and waits until its model is loaded (ServelabError
    when it cannot start: the engine's own error, e.g. a bad policy name)."""

    def __init__(self, config: Any, threads: int | None = None, name: str = "servelab-engine") -> None:
        from servelab.logging_setup import configured_verbosity

        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked locks or torch threads
        commands_out, self._commands = context.Pipe(duplex=False)
        self._outputs, outputs_in = context.Pipe(duplex=False)
        self.process = context.Process(target=_engine_main, name=name, daemon=True,
                                       args=(config, commands_out, outputs_in, configured_verbosity(), threads))
        self.process.start()
        commands_out.close()  # the child's ends: only the child may hold them, so that
        outputs_in.close()  # either side sees EOF when the other one goes away
        self._reader: threading.Thread | None = None
        self._stopping = False
        self.info = self._wait_ready()
        logger.info("engine.process_started", pid=self.process.pid, max_model_len=self.info.max_model_len)

    def _wait_ready(self) -> EngineInfo:
        if not self._outputs.poll(_START_TIMEOUT):
            self._kill()
            raise ServelabError(f"the engine process did not start within {_START_TIMEOUT:g} s")
        try:
            kind, payload = self._outputs.recv()
        except (EOFError, OSError):
            self.process.join(5)
            raise ServelabError(f"the engine process exited while starting ({exit_status(self.process.exitcode)})")
        if kind == "failed":
            self.process.join(5)
            raise payload
        return payload

    @staticmethod
    def clock() -> float:
        import time

        return time.perf_counter()  # CLOCK_MONOTONIC: the same in every process of the machine

    def start(self, on_output: OnOutput, on_exit: OnExit) -> None:
        self._reader = threading.Thread(target=self._read, args=(on_output, on_exit), daemon=True,
                                        name="servelab-engine-reader")
        self._reader.start()

    def send(self, command: Command) -> None:
        try:
            self._commands.send(command)
        except (OSError, ValueError):  # the engine process is gone; the reader reports it
            pass

    def stop(self, timeout: float) -> None:
        self._stopping = True
        self.send(("stop", None, None))
        if self._reader is not None:
            self._reader.join(timeout)
        self.process.join(timeout)
        if self.process.is_alive():
            logger.warning("engine.process_kill", pid=self.process.pid)
            self._kill()
        self._commands.close()

    def _read(self, on_output: OnOutput, on_exit: OnExit) -> None:
        while True:
            try:
                output = self._outputs.recv()
            except (EOFError, OSError):
                break
            on_output(output)
        if not self._stopping:
            self.process.join(5)
            on_exit(f"the engine process exited unexpectedly ({exit_status(self.process.exitcode)})")

    def _kill(self) -> None:
        self.process.kill()
        self.process.join(5)


def _engine_main(config: Any, commands: Any, outputs: Any, verbosity: int | None, threads: int | None) -> None:
    """The engine process: load the model, say so, run the core until "stop" or EOF."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    if verbosity is not None:
        from servelab.logging_setup import configure_logging

        configure_logging(verbosity)

    def send(message: Any) -> None:
        try:
            outputs.send(message)
        except OSError:  # the server's process is gone: nobody is listening
            os._exit(0)

    try:
        from servelab.engine import LLMEngine
        from servelab.registry import PluginRegistry

        engine = LLMEngine(config, PluginRegistry.from_entry_points())
    except Exception as exc:
        send(("failed", _portable(exc)))
        return
    send(("ready", EngineInfo.of(engine)))

    def receive(block: bool) -> list[Command]:
        try:
            received = [commands.recv()] if block else []
            while commands.poll():
                received.append(commands.recv())
        except (EOFError, OSError):  # the server's process is gone
            received = [("stop", None, None)]
        return received

    try:
        EngineCore(engine, receive, send).run()
    finally:
        engine.close()  # tensor parallelism: the other ranks stop with the engine


def _portable(exc: Exception) -> Exception:
    """The exception itself when it survives pickling, else a ServelabError with its message."""
    import pickle

    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return ServelabError(f"{type(exc).__name__}: {exc}")

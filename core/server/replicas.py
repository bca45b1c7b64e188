"""Engine replicas as Ray actors (`servelab serve --replicas N`).

Each replica is an `EngineActor`: an `EngineCore` (engine_core.py) on a thread of a Ray
actor, reached through a `RayActorConnection` (commands go down as actor calls, and a
long poll brings back every CoreOutput produced since the last one, in one batch), so
each replica is an `AsyncEngine` like the single engine; `launch_replicas` starts them
and puts them in a `ReplicaSet` (replica_set.py) with the configured router.

Ray is an optional dependency (`pip install 'servelab[ray]'`). Without `--ray-address`
the command starts a local Ray instance and stops it on exit; with one it joins that
cluster, whose nodes need servelab (and any plugin the config names) installed.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import Any, Sequence as Seq

import attrs
import structlog

from servelab.errors import ServelabError
from servelab.interfaces import RouterContext
from servelab.server.engine_connection import OnExit, OnOutput, take_commands
from servelab.server.engine_core import Command, EngineCore, EngineInfo
from servelab.server.engine_loop import AsyncEngine
from servelab.server.liveness import POLL_SECONDS
from servelab.server.replica_set import ReplicaSet

logger = structlog.get_logger(__name__)
_START_TIMEOUT = 600.0


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ServelabError("replicas run on Ray, which is not installed: pip install 'servelab[ray]'") from None
    return ray


class EngineActor:
    """One replica: the engine and its core loop, inside a Ray actor (made remote at launch)."""

    def __init__(self, config: Any, replica_id: int, threads: int | None, verbosity: int | None) -> None:
        if verbosity is not None:
            from servelab.logging_setup import configure_logging

            configure_logging(verbosity)
        if threads is not None:
            import torch

            torch.set_num_threads(threads)
        from servelab.engine import LLMEngine
        from servelab.registry import PluginRegistry

        self.replica_id = replica_id
        self.engine = LLMEngine(config, PluginRegistry.from_entry_points())
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._next_batch = 0  # actor calls may run out of order: command batches carry a number
        self._early: dict[int, list[Command]] = {}
        self._order = threading.Lock()  # a threaded actor may run two send() calls at once
        self._outputs: list[Any] = []
        self._ready = threading.Condition()
        self._done = False
        core = EngineCore(self.engine, self._receive, self._send, count_running_tokens=True)
        self._thread = threading.Thread(target=self._run, args=(core,), name="servelab-engine", daemon=True)
        self._thread.start()

    def info(self) -> tuple[EngineInfo, int]:
        """The engine's limits, and this process's id."""
        engine = self.engine
        return EngineInfo.of(engine), os.getpid()

    def send(self, batch: int, commands: list[Command]) -> None:
        now = time.perf_counter()  # arrival times come as ages (clocks differ between machines)
        with self._order:
            self._early[batch] = [_with_clock(command, now) for command in commands]
            while self._next_batch in self._early:
                for command in self._early.pop(self._next_batch):
                    self._commands.put(command)
                self._next_batch += 1

    def poll(self, timeout: float) -> tuple[list[Any], bool]:
        """The core's outputs since the last poll (waiting up to `timeout` for one), and
        whether the core has stopped."""
        with self._ready:
            self._ready.wait_for(lambda: self._outputs or self._done, timeout)
            outputs, self._outputs = self._outputs, []
            return outputs, self._done

    def _run(self, core: EngineCore) -> None:
        try:
            core.run()
        finally:
            with self._ready:
                self._done = True
                self._ready.notify_all()

    def _send(self, output: Any) -> None:
        with self._ready:
            self._outputs.append(output)
            self._ready.notify_all()

    def _receive(self, block: bool) -> list[Command]:
        return take_commands(self._commands, block)


def _with_clock(command: Command, now: float) -> Command:
    kind, command_id, payload = command
    if kind != "add":
        return command
    return kind, command_id, [attrs.evolve(r, arrival_time=now + r.arrival_time) for r in payload]


class RayActorConnection:
    """An EngineConnection to an EngineActor."""

    def __init__(self, actor: Any, replica_id: int, info: EngineInfo) -> None:
        self.actor = actor
        self.replica_id = replica_id
        self.info = info
        self._batches = 0
        self._stopping = False
        self._reader: threading.Thread | None = None

    @staticmethod
    def clock() -> float:
        return time.perf_counter()

    def start(self, on_output: OnOutput, on_exit: OnExit) -> None:
        self._reader = threading.Thread(target=self._read, args=(on_output, on_exit), daemon=True,
                                        name=f"servelab-replica-{self.replica_id}")
        self._reader.start()

    def send(self, command: Command) -> None:
        kind, command_id, payload = command
        if kind == "add":  # the actor's clock may not be ours: send each request's age
            now = time.perf_counter()
            command = kind, command_id, [attrs.evolve(r, arrival_time=r.arrival_time - now) for r in payload]
        self.actor.send.remote(self._batches, [command])
        self._batches += 1

    def stop(self, timeout: float) -> None:
        self._stopping = True
        self.send(("stop", None, None))
        if self._reader is not None:
            self._reader.join(timeout)
        import_ray().kill(self.actor)

    def _read(self, on_output: OnOutput, on_exit: OnExit) -> None:
        ray = import_ray()
        while True:
            try:
                outputs, done = ray.get(self.actor.poll.remote(POLL_SECONDS))
            except Exception as exc:  # RayActorError and its kin: the actor (or its node) is gone
                if not self._stopping:
                    on_exit(f"engine replica {self.replica_id} failed: its Ray actor died "
                            f"({type(exc).__name__}: {_first_line(exc)})")
                return
            for output in outputs:
                if output.failure is not None:
                    output = attrs.evolve(output, failure=f"engine replica {self.replica_id}: {output.failure}")
                on_output(output)
            if done:
                return


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else "no message"


def replica_configs(config: Any, num_replicas: int) -> list[Any]:
    """Each replica's config: `config`, with a file-backed host tier (`[kv_offload] path`)
    moved to a file of the replica's own, `<path>.replica<index>`. A host tier's bookkeeping
    lives in its engine, so replicas sharing one file would overwrite each other's KV
    (tier_file.py refuses a second engine on a locked file)."""
    path = config.kv_offload.path
    if not path:
        return [config] * num_replicas
    return [attrs.evolve(config, kv_offload=attrs.evolve(config.kv_offload, path=f"{path}.replica{index}"))
            for index in range(num_replicas)]


def launch_replicas(configs: Seq[Any], ray_address: str | None = None, threads: int | None = None,
                    metrics: Any = None, num_cpus_per_replica: float = 1.0) -> tuple[ReplicaSet, bool]:
    """Start one EngineActor per config (on the cluster at `ray_address`, else on a local Ray
    started here) and wait until every model is loaded. Returns the ReplicaSet, and whether
    Ray was started here (the caller then stops it with `ray.shutdown()`)."""
    from servelab.logging_setup import configured_verbosity
    from servelab.registry import PluginRegistry
    from servelab.routing import build_router, router_section

    models = {config.engine.model for config in configs}
    if len(models) != 1:
        raise ServelabError(f"every replica must serve the same model, got {sorted(models)}")
    block_size = configs[0].engine.block_size
    router = build_router(configs[0], PluginRegistry.from_entry_points(), RouterContext(  # names checked first
        num_replicas=len(configs), block_size=block_size, num_kv_blocks=0))
    ray = import_ray()
    started_here = start_ray(ray, ray_address, len(configs), num_cpus_per_replica)
    remote = ray.remote(num_cpus=num_cpus_per_replica, max_concurrency=4)(EngineActor)
    verbosity = configured_verbosity()
    actors = [remote.remote(config, index, threads, verbosity) for index, config in enumerate(configs)]
    infos = wait_started(ray, actors, started_here)
    engines = []
    for index, (actor, (info, pid)) in enumerate(zip(actors, infos)):
        logger.info("replica.started", replica=index, pid=pid, max_model_len=info.max_model_len)
        engines.append(AsyncEngine(RayActorConnection(actor, index, info), name=f"replica {index}"))
    return ReplicaSet(engines, router, router_section(configs[0]).name, block_size, metrics), started_here


def start_ray(ray: Any, ray_address: str | None, num_actors: int, num_cpus_per_actor: float) -> bool:
    """Join the cluster at `ray_address`, or start a local Ray with a CPU for each actor;
    whether Ray was started here (the caller then stops it)."""
    if ray.is_initialized():
        return False
    options: dict[str, Any] = {"include_dashboard": False, "logging_level": "WARNING"}
    started_here = False
    if ray_address is None:  # a new local instance, never one that happens to run on this machine
        started_here = True
        ray_address = "local"
        options["object_store_memory"] = 128 * 1024 * 1024  # outputs are small messages, not objects
        options["num_cpus"] = max(os.cpu_count() or 1, int(num_actors * num_cpus_per_actor + 0.999))
    ray.init(address=ray_address, **options)
    return started_here


def wait_started(ray: Any, actors: list[Any], started_here: bool, noun: str = "replica") -> list[Any]:
    """Each actor's `info()` once its model is loaded; on any failure the actors are killed
    (and Ray stopped, if `started_here`) before the error goes on."""
    try:
        return _infos(ray, actors, noun)
    except BaseException:
        for actor in actors:
            ray.kill(actor)
        if started_here:
            ray.shutdown()
        raise


def _infos(ray: Any, actors: list[Any], noun: str) -> list[Any]:
    pending = {actor.info.remote(): index for index, actor in enumerate(actors)}
    results: dict[int, Any] = {}
    ready, not_ready = ray.wait(list(pending), num_returns=len(pending), timeout=_START_TIMEOUT)
    if not_ready:
        raise ServelabError(f"{len(not_ready)} of {len(actors)} {noun}s did not start within {_START_TIMEOUT:g} s "
                            f"(does the Ray cluster have a CPU free for each?)")
    for ref in ready:
        index = pending[ref]
        try:
            results[index] = ray.get(ref)
        except Exception as exc:
            cause = getattr(exc, "cause", None) or exc
            raise ServelabError(f"{noun} {index} could not start: {_first_line(cause)}") from None
    return [results[index] for index in range(len(actors))]

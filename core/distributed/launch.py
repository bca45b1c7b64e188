"""Starting the tensor-parallel ranks and watching them.

Two ways in:

- the engine starts ranks 1..N-1 itself, each as `python -m servelab.distributed.worker`
  (a fresh interpreter that runs only servelab's worker: unlike multiprocessing's spawn,
  it never re-imports the user's main script, so a script needs no `__main__` guard),
  and joins them over a TCP rendezvous on localhost;
- under `torchrun` (WORLD_SIZE = N in the environment) every rank runs the same program;
  rank 0 becomes the engine and the others serve it from inside `LLMEngine(...)`, then
  exit when the engine closes.

Backend: gloo on the CPU, NCCL on CUDA (plus a gloo group for rank 0's step messages).
Each spawned worker holds one end of a socket pair with rank 0: it reports start-up
("hello", "ready", or the error) over it, and exits the moment rank 0's end closes, so no
worker outlives the engine however it ends. Workers ignore SIGINT (rank 0 decides when
to stop) and count the messages they finished in a small shared file, so rank 0 can tell
which rank fell behind when a collective fails or times out.
"""

from __future__ import annotations

import datetime
import mmap
import multiprocessing.connection
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist

from servelab.distributed.comm import Communicator, SocketChannel, recv_frame, send_frame
from servelab.distributed.shard_runner import ShardSpec
from servelab.errors import DistributedError

_IDLE_TIMEOUT = datetime.timedelta(days=365)  # a worker waits for rank 0's next step this long


def launched_by_torchrun(size: int) -> bool:
    """This process is one of `size` ranks started by torchrun (or another env:// launcher)."""
    return "RANK" in os.environ and os.environ.get("WORLD_SIZE") == str(size)


def cpu_threads_per_rank(size: int) -> int:
    """The process's compute threads (torch's setting, the cores by default) shared out."""
    return max(1, torch.get_num_threads() // size)


def init_group(backend: str, rank: int, size: int, init_method: str | None, timeout_s: float,
               device: torch.device, channel: SocketChannel | None = None) -> Communicator:
    """Join the default process group (env:// when init_method is None) and build the
    collectives; without a socket `channel`, step messages get a gloo group of their own."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method or "env://", rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    control = None if channel is not None else dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)
    return Communicator(rank, size, device, control_group=control, channel=channel)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]




class ProgressCounters:
    """Per rank, in a shared, memory-mapped file: the messages it finished (one int64), and
    under pipeline parallelism its stage's compute and wait seconds so far (two float64),
    which rank 0 reads without asking."""

    def __init__(self, path: str, size: int, create: bool = False) -> None:
        self.path = path
        if create:
            with open(path, "wb") as handle:
                handle.write(bytes(24 * size))
        with open(path, "r+b") as handle:
            self._map = mmap.mmap(handle.fileno(), 24 * size)
        self.counts = np.frombuffer(self._map, dtype=np.int64, count=size)
        self.stage_times = np.frombuffer(self._map, dtype=np.float64, offset=8 * size).reshape(size, 2)

    def close(self) -> None:
        self.counts = self.stage_times = None
        self._map.close()


class WorkerSet:
    """Ranks 1..N-1 as child processes, and what rank 0 knows of their health."""

    def __init__(self, spec: ShardSpec, timeout_s: float, threads: int) -> None:
        self.size = spec.size
        self.timeout_s = timeout_s
        self.init_method = f"tcp://127.0.0.1:{_free_port()}"
        handle, path = tempfile.mkstemp(prefix="servelab-tp-progress-")
        os.close(handle)
        self.progress = ProgressCounters(path, spec.size, create=True)
        self.processes: dict[int, subprocess.Popen] = {}
        self.sockets: dict[int, socket.socket] = {}
        for rank in range(1, spec.size):
            ours, theirs = socket.socketpair()
            with theirs:
                self.processes[rank] = subprocess.Popen(
                    [sys.executable, "-m", "servelab.distributed.worker", str(theirs.fileno())],
                    pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
            ours.settimeout(timeout_s)  # a send to a stuck worker whose buffer is full fails in time
            self.sockets[rank] = ours
            send_frame(ours, pickle.dumps((spec, rank, self.init_method, timeout_s, threads, path)))

    def channel(self) -> SocketChannel:
        return SocketChannel([self.sockets[rank] for rank in sorted(self.sockets)])

    def wait_for(self, what: str, timeout_s: float) -> None:
        """Every worker's `what` message; a DistributedError naming the rank that died,
        failed or stayed silent."""
        pending = set(self.processes)
        deadline = time.monotonic() + timeout_s
        while pending:
            ready = multiprocessing.connection.wait([self.sockets[r] for r in pending],
                                                    timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                ranks = ", ".join(map(str, sorted(pending)))
                raise DistributedError(f"tensor-parallel rank(s) {ranks} did not report {what!r} within "
                                       f"{timeout_s:g} s")
            for rank in [r for r in pending if self.sockets[r] in ready]:
                try:
                    frame = recv_frame(self.sockets[rank])
                except OSError:
                    frame = None
                if frame is None:
                    raise DistributedError(self.death_message(rank, f"while starting ({what})"))
                kind, detail = pickle.loads(frame)
                if kind == "error":
                    raise DistributedError(f"tensor-parallel rank {rank} failed to start: {detail}")
                if kind == what:
                    pending.discard(rank)

    def dead_ranks(self) -> list[int]:
        return [rank for rank, process in self.processes.items() if process.poll() is not None]

    def death_message(self, rank: int, when: str) -> str:
        process = self.processes[rank]
        try:
            code = process.wait(1.0)
        except subprocess.TimeoutExpired:
            code = None
        if code is None:
            how = "stopped answering"
        elif code < 0:
            how = f"was killed by {signal.Signals(-code).name}"
        else:
            how = f"exited with code {code}"
        return f"tensor-parallel rank {rank} (pid {process.pid}) {how} {when}"

    def diagnose(self, expected: int, when: str, error: BaseException) -> str:
        """Which rank broke a step: a dead one; on a timeout, those that did not finish
        `expected` messages; else rank 0 itself (its error)."""
        timed_out = isinstance(error, (TimeoutError, socket.timeout)) or "timed out" in str(error).lower()
        deadline = time.monotonic() + 2.0
        while not self.dead_ranks() and time.monotonic() < deadline and not timed_out:
            time.sleep(0.05)  # a peer's socket closes a moment before its exit is visible
        dead = self.dead_ranks()
        if dead:
            return "; ".join(self.death_message(rank, when) for rank in dead)
        behind = [rank for rank in self.processes if self.progress.counts[rank] < expected]
        if timed_out and behind:
            return (f"tensor-parallel rank(s) {', '.join(map(str, behind))} did not finish {when} within "
                    f"{self.timeout_s:g} s ({type(error).__name__}: {str(error).splitlines()[0][:200]})")
        return f"tensor-parallel rank 0 failed {when}: {type(error).__name__}: {error}"

    def stop(self, grace_s: float = 5.0) -> None:
        """Wait for the workers to leave (after a stop message), then hang up on them,
        then kill whoever is left."""
        deadline = time.monotonic() + grace_s
        for process in self.processes.values():
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for sock in self.sockets.values():
            sock.close()  # a worker exits when our end closes
        for process in self.processes.values():
            try:
                process.wait(2.0)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(2.0)
        self.progress.close()
        try:
            os.unlink(self.progress.path)
        except OSError:
            pass

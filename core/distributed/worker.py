"""A spawned tensor-parallel rank: `python -m servelab.distributed.worker FD`.

FD is this worker's end of a socket pair with rank 0 (see servelab.distributed.launch):
the shard spec arrives on it, start-up is reported on it, and its closing means rank 0
is gone, which ends this process at once.
"""

from __future__ import annotations

import signal
import sys

signal.signal(signal.SIGINT, signal.SIG_IGN)  # before the slow imports: Ctrl-C is rank 0's to handle

import multiprocessing.connection  # noqa: E402
import os  # noqa: E402
import threading  # noqa: E402
import traceback  # noqa: E402


def _exit_when_closed(conn: multiprocessing.connection.Connection) -> None:
    try:
        while True:
            conn.recv()
    except (EOFError, OSError):
        pass
    os._exit(1)


def main(fd: int) -> None:
    conn = multiprocessing.connection.Connection(fd)
    spec, rank, init_method, timeout_s, threads, progress_path = conn.recv()
    threading.Thread(target=_exit_when_closed, args=(conn,), daemon=True).start()
    try:
        conn.send(("hello", None))
        import torch

        from servelab.distributed.launch import ProgressCounters, backend_for, init_group
        from servelab.distributed.shard_runner import build_shard_runner, rank_device, serve

        if threads:
            torch.set_num_threads(threads)
        device = rank_device(spec.engine, rank)
        comm = init_group(backend_for(device), rank, spec.size, init_method, timeout_s, device)
        runner = build_shard_runner(spec, rank, comm)
        progress = ProgressCounters(progress_path, spec.size)
    except BaseException as exc:  # noqa: BLE001 - reported to rank 0, which raises it
        conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=-3)}"))
        return
    conn.send(("ready", None))

    def done() -> None:
        progress.counts[rank] += 1

    try:
        serve(runner, comm, done)
    except Exception:  # noqa: BLE001 - rank 0 went away or a collective failed: rank 0 reports it
        os._exit(1)
    # Told to stop: leave at once, without tearing down gloo's threads (rank 0 waits for
    # this exit before it destroys its own group).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(int(sys.argv[1]))

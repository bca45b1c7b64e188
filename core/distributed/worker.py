"""A spawned tensor-parallel rank: `python -m servelab.distributed.worker FD`.

FD is this worker's end of a socket pair with rank 0 (see servelab.distributed.launch):
the shard spec arrives on it, start-up is reported on it, step messages arrive on it, and
its closing means rank 0 is gone, which ends this process.
"""

from __future__ import annotations

import signal
import sys

if __name__ == "__main__":  # before the slow imports: Ctrl-C is rank 0's to handle
    signal.signal(signal.SIGINT, signal.SIG_IGN)

import os  # noqa: E402
import pickle  # noqa: E402
import select  # noqa: E402
import socket  # noqa: E402
import threading  # noqa: E402
import traceback  # noqa: E402

from servelab.distributed.comm import SocketChannel, recv_frame, send_frame  # noqa: E402


def _exit_if_closed_while_starting(sock: socket.socket, started: threading.Event) -> None:
    """Rank 0 sends nothing while this rank starts: the socket turning readable then means
    rank 0 has gone, and a half-started rank must not linger."""
    select.select([sock], [], [])
    if not started.is_set():
        os._exit(1)


def main(fd: int) -> None:
    sock = socket.socket(fileno=fd)
    frame = recv_frame(sock)
    if frame is None:
        return
    spec, rank, init_method, timeout_s, threads, progress_path = pickle.loads(frame)
    started = threading.Event()
    threading.Thread(target=_exit_if_closed_while_starting, args=(sock, started), daemon=True).start()
    try:
        send_frame(sock, pickle.dumps(("hello", None)))
        import torch

        from servelab.distributed.launch import ProgressCounters, backend_for, init_group
        from servelab.distributed.shard_runner import build_shard_runner, rank_device, serve

        if threads:
            torch.set_num_threads(threads)
        device = rank_device(spec.engine, rank)
        comm = init_group(backend_for(device), rank, spec.size, init_method, timeout_s, device,
                          SocketChannel([sock]))
        runner = build_shard_runner(spec, rank, comm)
        progress = ProgressCounters(progress_path, spec.size)
    except BaseException as exc:  # noqa: BLE001 - reported to rank 0, which raises it
        send_frame(sock, pickle.dumps(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=-3)}")))
        return
    started.set()
    send_frame(sock, pickle.dumps(("ready", None)))

    stage_stats = runner.model.pipeline[2] if spec.pipeline_parallel else None  # (links, layers, stats)

    def done() -> None:
        progress.counts[rank] += 1
        if stage_stats is not None:
            progress.stage_times[rank] = (stage_stats.compute_s, stage_stats.wait_s)

    try:
        serve(runner, comm, done, spec)
    except Exception:  # noqa: BLE001 - rank 0 went away or a collective failed: rank 0 names this rank
        print(f"servelab tensor-parallel rank {rank}: {traceback.format_exc(limit=-2)}", file=sys.stderr, flush=True)
        os._exit(1)
    # Told to stop (or rank 0 hung up): leave at once, without tearing down gloo's threads.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(int(sys.argv[1]))

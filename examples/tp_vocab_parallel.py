"""Vocab-parallel or replicated embedding and LM head under tensor parallelism? Measured.

Two ranks over gloo on this machine's CPU, each with half the cores, time what each
choice costs per decode step at builtin:tiny-random's shape (hidden 512, vocabulary
8192, float32), one row per sequence:

- LM head, replicated: rank 0 multiplies by the whole [8192, 512] head; the others idle.
- LM head, vocab-parallel: every rank multiplies by its [4096, 512] half, rank 0 gathers
  the columns (what servelab does).
- embedding, replicated: every rank looks the rows up in a whole table.
- embedding, vocab-parallel: every rank looks up the rows it holds (zeros for the rest)
  and the ranks all-reduce (what servelab does).

    python examples/tp_vocab_parallel.py

prints the median microseconds of each over 300 repetitions, per batch size.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

HIDDEN, VOCAB, SIZE, REPEATS = 512, 8192, 2, 300
BATCHES = (1, 8, 64)


def _time(fn) -> float:
    for _ in range(20):
        fn()
    samples = []
    for _ in range(REPEATS):
        dist.barrier()
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return 1e6 * statistics.median(samples)


def _rank(rank: int, port: int, results) -> None:
    torch.set_num_threads(max(1, torch.get_num_threads() // SIZE))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=SIZE)
    generator = torch.Generator().manual_seed(0)
    head = torch.randn(VOCAB, HIDDEN, generator=generator)
    half = head[rank * VOCAB // SIZE:(rank + 1) * VOCAB // SIZE].contiguous()
    for batch in BATCHES:
        hidden = torch.randn(batch, HIDDEN, generator=generator)
        ids = torch.randint(0, VOCAB, (batch,), generator=generator)

        def head_replicated():
            if rank == 0:
                F.linear(hidden, head)
            dist.barrier()  # the step ends when rank 0 has its logits

        def head_parallel():
            local = F.linear(hidden, half)
            shards = [torch.empty_like(local) for _ in range(SIZE)] if rank == 0 else None
            dist.gather(local, shards, dst=0)
            if rank == 0:
                torch.cat(shards, dim=1)

        def embedding_replicated():
            F.embedding(ids, head)

        def embedding_parallel():
            local = ids - rank * VOCAB // SIZE
            outside = (local < 0) | (local >= VOCAB // SIZE)
            rows = F.embedding(local.masked_fill(outside, 0), half)
            rows.masked_fill_(outside.unsqueeze(-1), 0)
            dist.all_reduce(rows)

        timings = {name: _time(fn) for name, fn in [("LM head, replicated", head_replicated),
                                                    ("LM head, vocab-parallel", head_parallel),
                                                    ("embedding, replicated", embedding_replicated),
                                                    ("embedding, vocab-parallel", embedding_parallel)]}
        if rank == 0:
            results[batch] = timings
    dist.destroy_process_group()


def main() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(port, results), nprocs=SIZE)
        print(f"two ranks over gloo, {max(1, torch.get_num_threads() // SIZE)} thread(s) each, "
              f"median us per call over {REPEATS}:")
        print("| batch | " + " | ".join(results[BATCHES[0]]) + " |")
        print("|---:|" + "---:|" * len(results[BATCHES[0]]))
        for batch in BATCHES:
            print(f"| {batch} | " + " | ".join(f"{v:.0f}" for v in results[batch].values()) + " |")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // SIZE)))
    sys.exit(main())

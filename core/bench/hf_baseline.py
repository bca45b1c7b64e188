"""The baseline everyone knows: `transformers` `generate`, greedy, in static batches."""

from __future__ import annotations

import os
import time
from typing import Any

from servelab.bench.metrics import percentiles
from servelab.workload import BenchRequest, Workload


def load_hf_model(checkpoint_dir: str, dtype: str, warm_up: list[BenchRequest] = ()) -> Any:
    """The model, warmed up on `warm_up` (a full-size batch, so the first measured batch
    pays no first-time allocations) with two new tokens each."""
    import attrs
    import torch
    import transformers

    where: dict[str, Any] = {}
    if checkpoint_dir.lower().endswith(".gguf"):  # transformers reads GGUF files from their folder
        folder, name = os.path.split(checkpoint_dir)
        checkpoint_dir, where = folder or ".", {"gguf_file": name}
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype=getattr(torch, dtype),
                                                              **where).eval()
    _generate(model, [attrs.evolve(r, max_tokens=2) for r in warm_up] or [BenchRequest([5, 6, 7], 2)])
    return model


def run_hf_static(model: Any, workload: Workload, batch_size: int) -> dict[str, Any]:
    """Batches of `batch_size` in arrival order, left padded; a batch starts when its last
    member has arrived and the previous batch is done, and runs until its longest request
    is complete. Only the tokens each request asked for count as output."""
    requests = sorted(workload.requests, key=lambda r: r.arrival_time)
    start = time.perf_counter()
    e2e_ms = []
    for i in range(0, len(requests), batch_size):
        batch = requests[i : i + batch_size]
        ready = start + max(r.arrival_time for r in batch)
        if time.perf_counter() < ready:
            time.sleep(ready - time.perf_counter())
        _generate(model, batch)
        done = time.perf_counter()
        e2e_ms += [1000 * (done - (start + r.arrival_time)) for r in batch]
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "num_requests": len(requests),
        "output_tokens": workload.num_output_tokens,
        "output_tokens_per_s": workload.num_output_tokens / seconds,
        "requests_per_s": len(requests) / seconds,
        "e2e_ms": percentiles(e2e_ms),
        "batch_size": batch_size,
    }


class HfStaticBaseline:
    """`transformers` generate in static batches, as a bench baseline."""

    name = "hf-static"

    def __init__(self, checkpoint_dir: str, dtype: str, batch_size: int, warm_up: list[BenchRequest]) -> None:
        self.model = load_hf_model(checkpoint_dir, dtype, warm_up)
        self.batch_size = batch_size

    def run(self, workload: Workload) -> dict[str, Any]:
        return run_hf_static(self.model, workload, self.batch_size)

    def close(self) -> None:
        self.model = None


def _generate(model: Any, batch: list[BenchRequest]) -> None:
    import torch

    width = max(len(r.prompt_token_ids) for r in batch)
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, r in enumerate(batch):
        ids[row, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
        mask[row, width - len(r.prompt_token_ids):] = 1
    longest = max(r.max_tokens for r in batch)
    with torch.inference_mode():
        model.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                       do_sample=False, pad_token_id=0, eos_token_id=None)

"""Tensor parallelism on the CPU: two ranks over gloo produce the single-process engine's
tokens (and transformers'), each rank holds half the sharded weights, and a rank that
dies or hangs ends the engine with an error naming it, leaving no process behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from servelab import LLM, ConfigError, SamplingParams
from servelab.distributed.comm import Communicator
from servelab.model.shard_layout import ShardLayout
from servelab.distributed.sharded_model import build_shard, parameter_bytes
from servelab.errors import DistributedError
from servelab.model.loader import Checkpoint, load_model

from test_hf_equivalence import hf_greedy, mixed_prompts
from test_speculative_decoding import medusa_heads

LENGTHS, MAX_NEW = [5, 17, 1, 33], [10, 6, 12, 8]
TP = {"tensor_parallel_size": 2, "tensor_parallel_timeout_s": 60}


def greedy(path: str, prompts, **engine) -> list[list[int]]:
    with LLM(path, max_model_len=96, block_size=8, **engine) as llm:
        outputs = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
                                         for n in MAX_NEW])
        assert llm.engine.allocator.stats().num_used_blocks == 0
        return [o.token_ids for o in outputs]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


# llama: GQA 6:2; llama-mha: 4:4, untied; qwen2: q/k/v biases; llama3-rope-tied: tied
# embeddings and one KV head, fewer than the ranks (replicated on both).
@pytest.mark.parametrize("kind", ["llama", "llama-mha", "qwen2", "llama3-rope-tied"])
def test_two_ranks_match_one_and_transformers(kind, checkpoint_factory):
    path = checkpoint_factory(kind)
    prompts = mixed_prompts(json.loads(Path(path, "config.json").read_text())["vocab_size"], LENGTHS, seed=3)
    expected = [hf_greedy(path, p, n) for p, n in zip(prompts, MAX_NEW)]
    assert greedy(path, prompts) == expected
    assert greedy(path, prompts, **TP) == expected
    if kind == "qwen2":  # the C++ backend's fused layer ops (RMSNorm + residual, rotary, SiLU) on shards
        assert greedy(path, prompts, **TP, **{"attention.name": "cpu-paged", "attention.build": "wait"}) == expected


def test_speculation_and_parallel_sampling_with_two_ranks(checkpoint_factory, tmp_path):
    """Medusa reads the target's LM head (a collective under TP); a draft model stays whole
    on rank 0; n > 1 forks the prompt's KV, whose copy-on-write copies every rank applies."""
    path = checkpoint_factory("llama")
    prompts = mixed_prompts(211, LENGTHS, seed=4)
    medusa = {"drafter": {"name": "medusa", "heads": medusa_heads(tmp_path, 72)}}
    expected = [hf_greedy(path, p, n) for p, n in zip(prompts, MAX_NEW)]
    assert greedy(path, prompts, config=medusa, **TP) == expected

    draft = {"drafter": {"name": "draft-model", "model": checkpoint_factory("llama-draft"),
                         "num_speculative_tokens": 3}}
    # unseeded: a request with its own seed is not drafted (its tokens must not depend on the batch);
    # the engine's own generator, seeded alike in both engines, still makes the runs comparable
    params = SamplingParams(max_tokens=9, temperature=0.9, n=3, ignore_eos=True)
    completions = []
    for engine in ({}, TP):
        with LLM(path, config=draft, max_model_len=96, block_size=4, **engine) as llm:
            completions.append([[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)])
            assert llm.engine.speculation_stats().num_draft_tokens > 0
    assert completions[0] == completions[1]


def test_each_rank_reads_and_holds_only_its_shard(checkpoint_factory):
    checkpoint = Checkpoint.open(checkpoint_factory("llama"))
    whole = load_model(checkpoint, "float32", "cpu", 64)
    replicated = sum(p.numel() * 4 for name, p in whole.named_parameters() if "norm" in name)
    sharded = parameter_bytes(whole) - replicated
    held, read = [], []
    for rank in range(2):  # built in this process: building a shard runs no collective
        layout = ShardLayout(checkpoint.config, rank, 2)
        shard = build_shard(checkpoint, layout, Communicator(rank, 2, torch.device("cpu")), "float32", "cpu", 64)
        held.append(parameter_bytes(shard) - replicated)
        read.append(shard.bytes_read - replicated)
    for rank in range(2):
        # vocabulary 211 pads to 2 x 106 rows: within 1% of half
        assert held[rank] == pytest.approx(sharded / 2, rel=0.01)
        assert read[rank] == pytest.approx(sharded / 2, rel=0.01)


def test_shapes_two_ranks_cannot_split_are_config_errors_before_any_process_starts(checkpoint_factory):
    with pytest.raises(ConfigError, match="num_attention_heads=6"):
        LLM(checkpoint_factory("llama"), tensor_parallel_size=4)


def test_a_killed_rank_ends_the_engine_with_an_error_naming_it(checkpoint_factory):
    llm = LLM(checkpoint_factory("llama"), max_model_len=96, tensor_parallel_size=2, tensor_parallel_timeout_s=4)
    params = SamplingParams(max_tokens=4, temperature=0)
    first = llm.generate([[5, 6, 7]], params)
    time.sleep(4.5)  # idle for longer than the timeout: an idle engine is not a stuck one
    assert llm.generate([[5, 6, 7]], params)[0].token_ids == first[0].token_ids
    (worker,) = llm.engine.runner._ranks.workers.processes.values()
    os.kill(worker.pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(DistributedError, match=r"rank 1 \(pid \d+\) was killed by SIGKILL"):
        llm.generate([[5, 6, 7, 8]], params)
    assert time.monotonic() - started < 10
    with pytest.raises(DistributedError, match="rank 1"):  # and stays stopped
        llm.generate([[5]], params)
    assert not alive(worker.pid)


def test_a_hung_rank_ends_the_engine_within_the_timeout(checkpoint_factory):
    llm = LLM(checkpoint_factory("llama"), max_model_len=96, tensor_parallel_size=2, tensor_parallel_timeout_s=3)
    (worker,) = llm.engine.runner._ranks.workers.processes.values()
    os.kill(worker.pid, signal.SIGSTOP)
    started = time.monotonic()
    try:
        with pytest.raises(DistributedError, match="rank.* 1 did not finish"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0))
    finally:
        if alive(worker.pid):
            os.kill(worker.pid, signal.SIGCONT)
    assert time.monotonic() - started < 15
    deadline = time.monotonic() + 5
    while alive(worker.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(worker.pid)


_SCRIPT = """
import sys
from servelab import LLM, SamplingParams
llm = LLM(sys.argv[1], max_model_len=64, tensor_parallel_size=2)
out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
print("TOKENS", out[0].token_ids, flush=True)
llm.close()
"""


def test_torchrun_launches_the_same_engine(checkpoint_factory, tmp_path):
    """Under torchrun every rank runs the script; rank 0 is the engine, rank 1 serves it
    from inside LLM(...) and exits when rank 0 closes."""
    path = checkpoint_factory("llama")
    script = tmp_path / "generate.py"
    script.write_text(_SCRIPT)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script), path],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith("TOKENS")]
    with LLM(path, max_model_len=64) as llm:
        expected = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert lines == [f"TOKENS {expected[0].token_ids}"]

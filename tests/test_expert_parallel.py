"""Expert parallelism on the CPU: two ranks over gloo, each holding its placement's
experts (the rest of the model replicated), produce one process's tokens (and
transformers'); placement policies are selectable by name; a rebalance from measured
load moves experts between the ranks without changing the output; no process is left
behind and every run is bounded in time."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from servelab import LLM, ConfigError, SamplingParams
from servelab.distributed.expert_parallel import AbsentExpert

from test_moe_models import MAX_NEW, PROMPTS, hf_greedy

EP = {"expert_parallel_size": 2, "tensor_parallel_timeout_s": 60}


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def run(path: str, check=None, **engine) -> list[list[int]]:
    with LLM(path, max_model_len=96, block_size=8, **engine) as llm:
        outputs = llm.generate(PROMPTS, [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
                                         for n in MAX_NEW])
        assert llm.engine.allocator.stats().num_used_blocks == 0
        if check is not None:
            check(llm)
        workers = list(llm.engine.runner._ranks.workers.processes.values()) if engine else []
    deadline = time.monotonic() + 10
    while any(alive(w.pid) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(w.pid) for w in workers), "a rank outlived the engine"
    return [o.token_ids for o in outputs]


def _holds(llm, expected_ranks0: dict[int, tuple[int, ...]]) -> None:
    model = llm.engine.runner.model
    for layer, block in model.sparse_blocks().items():
        held = tuple(e for e, expert in enumerate(block.experts) if not isinstance(expert, AbsentExpert))
        assert held == expected_ranks0[layer]


@pytest.mark.parametrize("kind, placement, rank0", [("mixtral", "linear", (0, 1, 2)),
                                                    ("qwen2_moe", "round_robin", (0, 2, 4, 6))])
def test_two_expert_ranks_match_one_process_and_transformers(checkpoint_factory, kind, placement, rank0):
    path = checkpoint_factory(kind)
    expected = hf_greedy(path)
    layers = [0, 1] if kind == "mixtral" else [0, 2]
    got = run(path, check=lambda llm: _holds(llm, dict.fromkeys(layers, rank0)), expert_placement=placement, **EP)
    assert got == expected


def test_a_rebalance_moves_hot_experts_and_keeps_the_output(checkpoint_factory):
    """`balanced` with a redundant replica, re-placed every two steps from the load rank 0
    measured: six expert slots where linear has five (the hot expert's replica), and the
    tokens stay transformers' (an expert split between replicas rounds within float error)."""
    path = checkpoint_factory("mixtral")
    seen = {}

    def check(llm):
        runner = llm.engine.runner
        seen["rebalances"] = runner.num_rebalances
        seen["placements"] = runner.placements()
        seen["load"] = runner.expert_load()

    got = run(path, check=check, expert_placement="balanced", redundant_experts=1, expert_rebalance_steps=2, **EP)
    assert got == hf_greedy(path)
    assert seen["rebalances"] >= 3
    for layer, placement in seen["placements"].items():
        assert sum(len(held) for held in placement.ranks) == 6  # five experts and one replica
        hottest = max(range(5), key=lambda e: seen["load"][layer][e])
        assert len(placement.replicas(hottest)) == 2 or placement.imbalance(seen["load"][layer]) < 1.2


def test_expert_parallelism_refuses_what_it_cannot_run(checkpoint_factory, llama_checkpoint):
    with pytest.raises(ConfigError, match="needs a mixture-of-experts model"):
        LLM(llama_checkpoint, max_model_len=64, expert_parallel_size=2)
    with pytest.raises(ConfigError, match="exceeds the model's 3 experts"):
        LLM(checkpoint_factory("mixtral-top1"), max_model_len=64, expert_parallel_size=4)
    with pytest.raises(ConfigError, match="expert_placement must be one of linear, round_robin, balanced"):
        LLM(checkpoint_factory("mixtral"), max_model_len=64, expert_placement="eplb")
    with pytest.raises(ConfigError, match="does not shard a mixture-of-experts model's experts yet"):
        LLM(checkpoint_factory("mixtral"), max_model_len=64, tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="tensor_parallel_size=2 and expert_parallel_size=4 combine only when equal"):
        LLM(checkpoint_factory("mixtral"), max_model_len=64, expert_parallel_size=4, tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="expert_parallel_size and pipeline_parallel_size > 1 do not combine"):
        LLM(checkpoint_factory("mixtral"), max_model_len=64, expert_parallel_size=2, pipeline_parallel_size=2)


@pytest.mark.parametrize("kind, ranks", [("mixtral", 2), ("qwen2_moe", 2), ("qwen3_moe", 2), ("mixtral", 4)])
def test_expert_and_tensor_parallelism_on_the_same_ranks_match_transformers(checkpoint_factory, kind, ranks):
    """EP x TP (vLLM's --enable-expert-parallel layout): the same ranks hold their experts and
    split every layer's attention heads (KV heads split, or replicated with four ranks over
    two), its output projection one all-reduce; the tokens stay transformers'."""
    from servelab.distributed.sharded_model import RowParallelLinear
    from transformers import AutoConfig

    path = checkpoint_factory(kind)
    heads = AutoConfig.from_pretrained(path).num_attention_heads
    seen = {}

    def check(llm):
        attention = llm.engine.runner.model.layers[0].self_attn
        seen["attention"] = (attention.num_heads, attention.num_kv_heads, isinstance(attention.o_proj, RowParallelLinear))
        per_head = llm.engine.limits.num_kv_blocks * llm.engine.config.engine.block_size * attention.head_dim
        seen["kv_heads_cached"] = llm.engine.runner.kv_caches[0][0].numel() / per_head

    assert run(path, check=check, expert_parallel_size=ranks, tensor_parallel_size=ranks,
               tensor_parallel_timeout_s=60) == hf_greedy(path)
    assert seen["attention"] == (heads // ranks, 1, True) and seen["kv_heads_cached"] == 1  # the pool holds its heads


def test_quantized_experts_spread_over_two_ranks(checkpoint_factory, tmp_path):
    """`weights = "int8"` under EP=2: each rank quantizes the experts it holds; the tokens are
    transformers' on the blocks' dequantized values, as in one process."""
    from test_moe_models import _dequantized_moe_checkpoint

    path = checkpoint_factory("qwen2_moe")
    expected = hf_greedy(_dequantized_moe_checkpoint(path, tmp_path / "dequantized", "int8"))
    assert run(path, weights="int8", quantized_activations="float", expert_placement="round_robin", **EP) == expected

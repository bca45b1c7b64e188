"""Pipeline parallelism on the CPU: the decoder's layers split into two stages over gloo,
steps cut into micro-batches in flight (a long prompt split across them), produce one
process's tokens (and transformers'), dense and mixture-of-experts models alike; each
rank holds only its stage's layers; rank 0 measures its bubble; no process is left behind."""

from __future__ import annotations

import pytest

from servelab import LLM, ConfigError
from servelab.distributed.pipeline_parallel import AbsentLayer, stage_layers

from test_expert_parallel import run
from test_moe_models import hf_greedy

PP = {"pipeline_parallel_size": 2, "tensor_parallel_timeout_s": 60}


def test_stages_are_consecutive_and_cover_every_layer():
    assert [list(stage_layers(5, r, 2)) for r in range(2)] == [[0, 1, 2], [3, 4]]
    assert [list(stage_layers(7, r, 3)) for r in range(3)] == [[0, 1, 2], [3, 4], [5, 6]]
    with pytest.raises(ValueError, match="needs at least as many decoder layers"):
        stage_layers(2, 0, 3)


@pytest.mark.parametrize("kind, micro_batches", [("qwen2_moe", 0), ("llama", 3)])
def test_two_stages_match_one_process_and_transformers(checkpoint_factory, kind, micro_batches):
    path = checkpoint_factory(kind)
    seen = {}

    def check(llm):
        runner = llm.engine.runner
        seen["held"] = [not isinstance(layer, AbsentLayer) for layer in runner.model.layers]
        seen["stats"] = runner.pipeline_stats()

    assert run(path, check=check, pipeline_micro_batches=micro_batches, **PP) == hf_greedy(path)
    layers = len(seen["held"])
    assert seen["held"] == [i < -(-layers // 2) for i in range(layers)]  # rank 0: the first stage only
    stats = seen["stats"]
    assert stats.steps > 0 and stats.wait_s > 0 and 0 < stats.bubble_fraction < 1
    # steps of several rows ran as two micro-batches in flight: the first step's prompts (49
    # rows: 25 and 24, the 37-token prompt split across both) and the decode steps while
    # two or more sequences run (the second longest request decodes 11 tokens)
    assert stats.micro_batches >= 2 * (1 + 11)


def test_pipeline_parallelism_refuses_what_it_cannot_run(checkpoint_factory):
    with pytest.raises(ConfigError, match="pipeline_parallel_size=3 exceeds the model's 2 decoder layers"):
        LLM(checkpoint_factory("mixtral"), max_model_len=64, pipeline_parallel_size=3)
    with pytest.raises(ConfigError, match="expert_parallel_size and pipeline_parallel_size > 1 do not combine"):
        LLM(checkpoint_factory("mixtral"), max_model_len=64, pipeline_parallel_size=2, expert_parallel_size=2)


def test_the_bench_reports_the_first_stages_bubble(checkpoint_factory):
    from servelab.bench.metrics import SLO
    from servelab.bench.session import BenchOptions, run_bench
    from servelab.config import EngineConfig

    config = EngineConfig().with_overrides({"engine.model": checkpoint_factory("llama"), "engine.max_model_len": 64,
                                            "engine.pipeline_parallel_size": 2,
                                            "engine.tensor_parallel_timeout_s": 60})
    options = BenchOptions(workload="skewed:num_requests=3,mean_prompt_len=10,mean_output_len=4,max_len=32",
                           repeats=1, slo=SLO(ttft_ms=1e9, tpot_ms=1e9))
    pipeline = run_bench([("pp2", config)], options)["runs"][0]["metrics"]["pipeline"]
    assert pipeline["steps"] > 0 and pipeline["micro_batches"] > 0
    assert 0 < pipeline["stage0_bubble_fraction"] < 1 and pipeline["stage0_compute_s"] > 0

"""Pipeline parallelism on the CPU: the decoder's layers split into two stages over gloo,
steps cut into micro-batches in flight (a long prompt split across them), produce one
process's tokens (and transformers'), dense and mixture-of-experts models alike; each
rank holds only its stage's layers; rank 0 measures its bubble; no process is left behind."""

from __future__ import annotations

import time

import pytest

from servelab import LLM, ConfigError, SamplingParams
from servelab.distributed.pipeline_parallel import AbsentLayer, stage_layers

from test_expert_parallel import run
from test_moe_models import MAX_NEW, PROMPTS, hf_greedy

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
    # every stage's times: the second stage computed and waited for the first's hidden states
    assert len(stats.stage_times) == 2 and stats.stage_times[0] == (stats.compute_s, stats.wait_s)
    assert stats.stage_times[1][0] > 0 and 0 < stats.stage_bubble_fractions[1] < 1
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
    assert len(pipeline["stage_bubble_fractions"]) == 2 and pipeline["stage_compute_s"][1] > 0
    assert pipeline["stage_bubble_fractions"][0] == pytest.approx(pipeline["stage0_bubble_fraction"])


def _staggered(path: str, abort_after: int | None = None, **engine) -> tuple[dict, object, list]:
    """The prompts arriving one per step under chunked prefill with a 16-token budget (so
    batches keep several sequences apart), each request's greedy tokens by id; with
    `abort_after`, request 1 is aborted that many steps after it arrived."""
    from test_expert_parallel import alive

    with LLM(path, max_model_len=96, block_size=8, max_num_batched_tokens=16, **{"scheduler.name": "chunked-prefill"},
             **PP, **engine) as llm:
        engine_ = llm.engine
        pending, ids, finished, steps = list(zip(PROMPTS, MAX_NEW)), [], {}, 0
        while pending or engine_.has_unfinished():
            if pending:
                prompt, max_new = pending.pop(0)
                ids.append(engine_.add_request(prompt, SamplingParams(max_tokens=max_new, temperature=0,
                                                                      ignore_eos=True)))
            if abort_after is not None and steps == abort_after + 1:
                aborted = engine_.abort(ids[1])
                assert aborted is not None and aborted.finish_reason == "abort"
            finished.update((out.request_id, out.token_ids) for out in engine_.step().finished)
            steps += 1
        assert engine_.allocator.stats().num_used_blocks == 0
        stats = engine_.pipeline_stats()
        workers = list(engine_.runner._ranks.workers.processes.values())
    deadline = time.monotonic() + 10
    while any(alive(w.pid) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(w.pid) for w in workers), "a rank outlived the engine"
    return {i: finished.get(request_id) for i, request_id in enumerate(ids)}, stats, ids


@pytest.mark.parametrize("kind", ["llama", "qwen2_moe"])
def test_batches_in_flight_match_transformers(checkpoint_factory, kind):
    """Two batches down the two stages at once (the default: one per stage): rank 0 plans
    and computes the next batch while the last stage runs the previous one, and the tokens
    stay transformers'."""
    path = checkpoint_factory(kind)
    tokens, stats, _ = _staggered(path)
    assert [tokens[i] for i in range(len(PROMPTS))] == hf_greedy(path)
    assert stats.batches_in_flight == 2 and stats.overlapped_batches >= 5


def test_one_batch_in_flight_when_asked(checkpoint_factory):
    path = checkpoint_factory("llama")
    tokens, stats, _ = _staggered(path, pipeline_batches_in_flight=1)
    assert [tokens[i] for i in range(len(PROMPTS))] == hf_greedy(path)
    assert stats.overlapped_batches == 0


def test_aborting_a_request_in_flight_ends_it_alone(checkpoint_factory):
    """An abort of a request whose batch is down the pipeline completes the batches in
    flight first (their tokens come with the next step), then frees its KV: the other
    requests keep transformers' tokens and no block stays held."""
    path = checkpoint_factory("llama")
    tokens, stats, _ = _staggered(path, abort_after=1)
    expected = hf_greedy(path)
    assert [tokens[i] for i in (0, 2, 3)] == [expected[i] for i in (0, 2, 3)]
    assert tokens[1] is None  # aborted: its output came back from abort(), not a step
    assert stats.overlapped_batches > 0


def test_batches_in_flight_refused_where_they_cannot_run(checkpoint_factory):
    with pytest.raises(ConfigError, match="pipeline_batches_in_flight=2 cannot be honoured: speculative decoding"):
        LLM(checkpoint_factory("llama"), max_model_len=64, pipeline_batches_in_flight=2,
            **{"drafter.name": "ngram"}, **PP)


def test_pipeline_stages_of_tensor_parallel_ranks_match_transformers(checkpoint_factory):
    """PP x TP: two stages of two TP ranks each (four processes): each rank holds its
    heads and MLP share of its stage's layers, the stages pass hidden states between TP
    counterparts, and the first stage's ranks compute the vocabulary together; the tokens
    stay transformers', with one batch in flight and with two."""
    path = checkpoint_factory("llama")
    seen = {}

    def check(llm):
        runner = llm.engine.runner
        seen["sizes"] = (runner.pipeline_parallel_size, runner.tensor_parallel_size, len(runner._ranks.workers.processes))
        first = next(layer for layer in runner.model.layers if not isinstance(layer, AbsentLayer))
        seen["heads"] = first.self_attn.num_heads

    expected = hf_greedy(path)
    assert run(path, check=check, tensor_parallel_size=2, **PP) == expected
    assert seen["sizes"] == (2, 2, 3)
    from transformers import AutoConfig

    assert seen["heads"] == AutoConfig.from_pretrained(path).num_attention_heads // 2
    tokens, stats, _ = _staggered(path, tensor_parallel_size=2)
    assert [tokens[i] for i in range(len(PROMPTS))] == expected and stats.overlapped_batches > 0


def test_prompt_logprobs_under_pipeline_and_tensor_parallelism_match_one_process(checkpoint_factory):
    path = checkpoint_factory("llama")
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3)
    with LLM(path, max_model_len=64) as llm:
        expected = llm.generate(PROMPTS[:2], params)
    with LLM(path, max_model_len=64, tensor_parallel_size=2, **PP) as llm:
        got = llm.generate(PROMPTS[:2], params)
    for one, split in zip(expected, got):
        assert split.token_ids == one.token_ids
        for a, b in zip(one.prompt_logprobs[1:], split.prompt_logprobs[1:]):
            assert set(a) == set(b) and all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)


def test_tensor_and_pipeline_parallelism_refuse_a_mixture_of_experts_model(checkpoint_factory):
    with pytest.raises(ConfigError, match="tensor_parallel_size > 1 does not shard a mixture-of-experts"):
        LLM(checkpoint_factory("mixtral"), max_model_len=64, tensor_parallel_size=2, **PP)


def test_a_request_finished_by_an_aborts_drain_comes_out_of_the_next_step(checkpoint_factory):
    """Two requests in one batch in flight; aborting one completes the batch first, which
    finishes the other: the engine still has a result to give, and the next step gives it."""
    path = checkpoint_factory("llama")
    with LLM(path, max_model_len=64, **PP) as llm:
        engine = llm.engine
        done = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        aborted = engine.add_request(PROMPTS[2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        assert engine.step().events == {}  # submitted, not completed
        assert engine.abort(aborted).finish_reason == "abort"
        assert engine.has_unfinished()
        result = engine.step()
        assert [out.request_id for out in result.finished] == [done]
        assert result.finished[0].token_ids == hf_greedy(path)[0][:1] and not engine.has_unfinished()
        assert engine.allocator.stats().num_used_blocks == 0


def test_equal_time_pieces_give_a_long_prompts_later_rows_fewer_tokens():
    """`equal_time` cuts a step's rows so each piece costs about the first piece's FLOPs:
    the later rows of one long prompt attend to more positions and come in smaller pieces;
    `fixed` cuts equal counts."""
    import types
    from pathlib import Path

    import torch

    from servelab.distributed.pipeline_parallel import piece_sizes, row_costs
    from servelab.model.model_config import ModelConfig
    from servelab.testing.tiny_model import tiny_checkpoint

    config = ModelConfig.from_directory(Path(tiny_checkpoint("llama")))
    prompt = types.SimpleNamespace(input_ids=torch.zeros(600, dtype=torch.long), positions=torch.arange(600))
    assert piece_sizes(prompt, 2, "fixed", config) == [300, 300]
    sizes = piece_sizes(prompt, 2, "equal_time", config)
    assert sizes[0] == 300 and sum(sizes) == 600 and len(sizes) == 3 and sizes[1] < 300
    costs = row_costs(prompt.positions, config)
    first = sum(costs[:300])
    start = 300
    for size in sizes[1:]:
        assert sum(costs[start:start + size]) <= first  # no piece costs more than the first
        start += size
    decodes = types.SimpleNamespace(input_ids=torch.zeros(8, dtype=torch.long), positions=torch.full((8,), 40))
    assert piece_sizes(decodes, 2, "equal_time", config) == [4, 4]  # equal rows, equal costs


def test_equal_time_pieces_match_transformers(checkpoint_factory):
    path = checkpoint_factory("llama")
    seen = {}
    assert run(path, check=lambda llm: seen.update(stats=llm.engine.runner.pipeline_stats()),
               pipeline_chunk_sizing="equal_time", **PP) == hf_greedy(path)
    assert seen["stats"].micro_batches > 0

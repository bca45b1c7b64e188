"""The published-engine models: the prefill-alone scheduler's step structure, host work in
the cost model, the ShareGPT-like workload, and bench_serving's figures from a simulated
run (small runs: the published-size ones are `servelab sim-check published`)."""

from __future__ import annotations

import statistics

import attrs
import pytest

import servelab.bench.sim.prefill_alone as prefill_alone
from servelab.bench.driver import StepRecorder, run_workload
from servelab.bench.sim import published
from servelab.bench.sim.cost_model import CostModel
from servelab.bench.sim.engine_models import VLLM_060, EngineCostModel, EngineSimSource, HostWork, engine_model
from servelab.bench.sim.hardware import accelerator
from servelab.bench.sim.runner import VirtualClock
from servelab.bench.sim.shapes import model_shape
from servelab.cli import main
from servelab.config import EngineConfig
from servelab.errors import ConfigError
from servelab.registry import PluginRegistry
from servelab.testing import SchedulerContract
from servelab.workload import BenchRequest, Workload


def test_sharegpt_like_matches_the_published_means_and_bench_serving_filter():
    workload = published.sharegpt_like(3000, vocab_size=1000)
    prompts = [len(r.prompt_token_ids) for r in workload.requests]
    outputs = [r.max_tokens for r in workload.requests]
    assert statistics.mean(prompts) == pytest.approx(published.SHAREGPT_MEAN_PROMPT, rel=0.05)
    assert statistics.mean(outputs) == pytest.approx(published.SHAREGPT_MEAN_OUTPUT, rel=0.05)
    assert min(prompts) >= 4 and min(outputs) >= 4 and max(prompts) <= 1024
    assert max(p + o for p, o in zip(prompts, outputs)) <= 2048
    assert statistics.median(prompts) < statistics.mean(prompts)  # heavy-tailed, most requests short
    assert all(r.arrival_time == 0 for r in workload.requests)


def test_sharegpt_like_arrives_poisson_at_the_rate():
    workload = published.sharegpt_like(2000, vocab_size=1000, rate=8)
    times = [r.arrival_time for r in workload.requests]
    assert times == sorted(times)
    assert times[-1] / len(times) == pytest.approx(1 / 8, rel=0.1)


def test_host_work_is_paid_per_call_and_per_step_with_multi_step_runs_sharing_the_call():
    host = HostWork(schedule_s=4e-3, schedule_sequence_s=1e-4, step_s=1e-3, step_sequence_s=1e-5)
    assert host.seconds(10, decode_only=False, steps_per_schedule=10) == pytest.approx(5e-3 + 1e-3 + 1e-4)
    assert host.seconds(10, decode_only=True, steps_per_schedule=10) == pytest.approx(5e-4 + 1e-3 + 1e-4)


def test_engine_cost_model_replaces_the_profiles_fixed_host_overhead_with_the_engines():
    shape, hardware = model_shape("llama-3-8b"), accelerator("a100")
    host = HostWork(step_s=2e-3, step_sequence_s=1e-4)
    plain = CostModel(shape, hardware)
    engine = EngineCostModel(shape, hardware, host=host)
    for query, context in (([1] * 8, [300] * 8), ([200], [200])):
        expected = plain.step(query, context, len(query)).seconds - hardware.step_overhead_s + 2e-3 + 1e-4 * len(query)
        assert engine.step(query, context, len(query)).seconds == pytest.approx(expected)
    with pytest.raises(ConfigError, match="fitted step terms"):
        EngineCostModel(model_shape("tiny-random"), accelerator("cpu-here"), host=host)


def test_unknown_engine_model_is_named():
    with pytest.raises(ConfigError, match="vllm-0.6.0"):
        engine_model("vllm-9")


def _sim_engine(steps: int, arrivals: list[float], prompt: int = 64, output: int = 12):
    from servelab.engine import LLMEngine

    clock = VirtualClock()
    model = attrs.evolve(VLLM_060, num_scheduler_steps=steps)
    source = EngineSimSource(model_shape("llama-3-8b"), accelerator("a100"), clock, model=model)
    config = source.fit_config(EngineConfig().with_overrides(model.engine_config(2048)))
    registry = PluginRegistry.from_entry_points()
    registry.register(prefill_alone)
    recorder = StepRecorder(clock)
    registry.register(recorder)
    engine = LLMEngine(config, registry, clock=clock, source=source)
    workload = Workload("t", tuple(BenchRequest(list(range(1, prompt + 1)), output, t) for t in arrivals))
    record = run_workload(engine, recorder, workload, "t")
    return record, engine.scheduler.runs


def test_prefill_alone_runs_prompts_alone_and_decodes_a_run_of_steps_between_admissions():
    arrivals = [0.0, 0.0, 0.013, 0.031, 0.05, 0.09]
    record, runs = _sim_engine(steps=4, arrivals=arrivals)
    traces = record.step_traces[0]
    assert len(runs) == len(traces)
    for trace in traces:
        assert not (trace.prefilling and trace.decoding)  # a prefill step stalls every decode
    by_run: dict[int, list] = {}
    for run, trace in zip(runs, traces):
        by_run.setdefault(run, []).append(trace)
    for members in by_run.values():
        if members[0].prefilling:
            assert len(members) == 1
        else:
            assert len(members) <= 4
            assert all(set(later.decoding) <= set(members[0].decoding) for later in members)  # nobody joins a run
    # an arrival during a run waits for it: every prefill step starts a run, right after the previous one ended
    assert sum(1 for members in by_run.values() if len(members) == 4) >= 2
    assert all(len(o.token_ids) == 12 for o in record.outputs)


def test_delivery_per_run_streams_a_runs_tokens_at_its_end():
    record, runs = _sim_engine(steps=5, arrivals=[0.0], output=11)
    sim = published.SimRun(record, runs)
    stepwise = published.figures(sim, per_run=False)
    chunked = published.figures(sim, per_run=True)
    # one prompt alone: a prefill step, then two runs of five decode steps
    assert chunked[published.ITL] == pytest.approx(5 * stepwise[published.ITL], rel=0.02)
    assert chunked[published.TTFT] == pytest.approx(stepwise[published.TTFT])
    assert chunked[published.E2E] == pytest.approx(stepwise[published.E2E])
    late = published.figures(sim, per_run=True, frontend_s=0.01)
    assert late[published.TTFT] == pytest.approx(chunked[published.TTFT] + 10)
    assert late[published.TPOT] == pytest.approx(chunked[published.TPOT])


def test_a_published_row_simulates_and_compares():
    run = attrs.evolve(published.PUBLISHED[2], num_prompts=50)  # SGLang 8B at 4 req/s, 50 prompts
    rows = published.compare((run,))
    assert [row["metric"] for row in rows] == list(run.published)
    for row in rows:
        assert row["simulated"] > 0
        assert row["ratio"] == pytest.approx(row["simulated"] / row["published"])
        assert row["in_band"] == (0.8 <= row["ratio"] <= 1.25)
    assert "figures within [0.8, 1.25]" in published.format_rows(rows)


def test_sim_check_rejects_a_bad_scale(capsys):
    assert main(["sim-check", "published", "--scale", "0"]) == 2
    assert "--scale" in capsys.readouterr().err


class TestPrefillAloneContract(SchedulerContract):
    factory = prefill_alone.PrefillAloneScheduler
    options = prefill_alone.PrefillAloneOptions(num_scheduler_steps=3)
    max_examples = 10

    # End to end on the tiny model, the case that preempts only: the scheduler reorders
    # steps of `continuous` and never touches tokens; all four cases take ~40 s here.
    @pytest.mark.parametrize("case", ["tight"])
    def test_greedy_tokens_match_the_reference_policies(self, case):
        super().test_greedy_tokens_match_the_reference_policies(case)


def test_sim_check_prints_every_published_figure_with_its_ratio(capsys, tmp_path):
    import json

    assert main(["sim-check", "published", "--scale", "0.01", "--json", str(tmp_path / "rows.json")]) == 0
    out = capsys.readouterr().out
    rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
    assert len(rows) == sum(len(run.published) for run in published.PUBLISHED)
    for run in published.PUBLISHED:
        for metric, value in run.published.items():
            assert f"| {metric} |" in out and f"{value:,.2f}" in out
    assert f"of {len(rows)} figures within [0.8, 1.25]" in out

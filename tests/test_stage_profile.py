"""The bench's per-stage profile: ms per step for each stage of the engine's step, binned
by step size, in the JSON and the table; and the stage timings behind it."""

from __future__ import annotations

import json

import pytest

from servelab.bench.metrics import SLO
from servelab.bench.report import format_table
from servelab.bench.session import BenchOptions, run_bench
from servelab.bench.stage_profile import BINS, STAGES, bin_label, stage_profile
from servelab.config import EngineConfig
from servelab.interfaces import AllocatorStats, SchedulerStats
from servelab.outputs import StepReport

ROW_KEYS = {"seqs", "min_seqs", "max_seqs", "steps", "ms_per_step", "engine_ms_p50", "engine_ms_p90"}
BIN_LABELS = [bin_label(low, high) for low, high in BINS]


def _report(num_seqs: int, schedule=0.001, prepare=0.002, forward=0.010, sample=0.003, update=0.004) -> StepReport:
    return StepReport(
        step_index=0, num_seqs=num_seqs, num_scheduled_tokens=num_seqs, num_preempted=0, num_finished=0,
        schedule_seconds=schedule, prepare_seconds=prepare, forward_seconds=forward, sample_seconds=sample,
        update_seconds=update, allocator_stats=AllocatorStats(num_blocks=1, num_used_blocks=0, num_free_blocks=1),
        scheduler_stats=SchedulerStats(num_waiting=0, num_running=num_seqs, num_preemptions=0))


def test_steps_land_in_the_bin_of_their_size():
    sizes = [1, 2, 8, 9, 32, 33, 64, 65, 256, 257, 1000]
    rows = stage_profile([_report(n) for n in sizes])
    assert [(row["seqs"], row["steps"]) for row in rows] == [
        ("1", 1), ("2-8", 2), ("9-32", 2), ("33-64", 2), ("65-256", 2), ("257+", 2)]
    assert rows[-1]["max_seqs"] is None and rows[0]["min_seqs"] == rows[0]["max_seqs"] == 1


def test_stage_means_and_engine_spread():
    rows = stage_profile([_report(64, schedule=0.001, forward=0.5), _report(64, schedule=0.003, forward=0.7),
                          _report(48, schedule=0.002, forward=0.6)])
    (row,) = rows
    ms = row["ms_per_step"]
    assert row["steps"] == 3
    assert ms["schedule"] == pytest.approx(2.0)
    assert ms["forward"] == pytest.approx(600.0)
    # engine per step, everything but the forward: schedule + 2 + 3 + 4 ms = 10, 12 and 11 ms
    assert ms["engine"] == pytest.approx(11.0)
    assert ms["engine"] == pytest.approx(ms["schedule"] + ms["prepare"] + ms["sample"] + ms["update"])
    assert row["engine_ms_p50"] == pytest.approx(11.0)
    assert row["engine_ms_p90"] == pytest.approx(11.8)  # interpolated between 11 and 12


def test_no_steps_no_rows():
    assert stage_profile([]) == []


def test_a_real_run_reports_its_profile_in_json_and_table(llama_checkpoint):
    config = EngineConfig().with_overrides({"engine.model": llama_checkpoint, "engine.max_model_len": 128,
                                            "engine.max_num_seqs": 12})
    options = BenchOptions(workload="skewed:num_requests=12,mean_prompt_len=16,mean_output_len=12,max_len=64",
                           slo=SLO(ttft_ms=1e9, tpot_ms=1e9))
    result = run_bench([("tiny", config)], options)
    metrics = json.loads(json.dumps(result))["runs"][0]["metrics"]  # as --json writes it
    rows = metrics["stage_profile"]
    assert rows, "a run with steps has a profile"
    assert sum(row["steps"] for row in rows) == metrics["steps"]
    assert [row["seqs"] for row in rows] == [label for label in BIN_LABELS if label in {r["seqs"] for r in rows}]
    for row in rows:
        assert set(row) == ROW_KEYS
        assert set(row["ms_per_step"]) == {*STAGES, "engine"}
        assert all(value >= 0 for value in row["ms_per_step"].values())
        assert row["ms_per_step"]["forward"] > 0  # the model ran
        assert row["engine_ms_p50"] <= row["engine_ms_p90"]
    table = format_table(result)
    assert "per-stage ms per step, tiny" in table
    for label in (row["seqs"] for row in rows):
        assert any(line.split()[:1] == [label] for line in table.splitlines())


def test_simulated_steps_report_wall_clock_stage_times():
    """The simulator's clock is virtual and stands still outside the forward; stage
    timings still measure the engine's own work."""
    config = EngineConfig().with_overrides({"engine.max_num_seqs": 16})
    options = BenchOptions(workload="skewed:num_requests=16,mean_prompt_len=64,mean_output_len=16,max_len=512",
                           sim_accelerator="h200", sim_model="llama-3-8b")
    rows = run_bench([("sim", config)], options)["runs"][0]["metrics"]["stage_profile"]
    assert sum(row["ms_per_step"]["schedule"] * row["steps"] for row in rows) > 0

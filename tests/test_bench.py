"""`servelab bench`: workloads, metrics, a real side-by-side run, JSON and plots."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections import Counter

import pytest

from servelab.bench.metrics import SLO, percentiles
from servelab.bench.report import format_table
from servelab.bench.session import BenchOptions, run_bench
from servelab.config import EngineConfig
from servelab.errors import ConfigError
from servelab.workload import Workload, build_workload, lognormal_length


def test_same_spec_same_requests_and_file_replay(tmp_path):
    first = build_workload("skewed:num_requests=20,seed=3", 500)
    assert build_workload("skewed:num_requests=20,seed=3", 500) == first
    assert build_workload("skewed:num_requests=20,seed=4", 500) != first
    path = tmp_path / "w.jsonl"
    first.save(path)
    replay = build_workload(f"file:{path}", 500)
    assert replay.requests == first.requests
    assert replay.name == first.name


def test_lognormal_lengths_have_the_requested_mean():
    rng = random.Random(0)
    draws = [lognormal_length(rng, 100, 0.8, 1, 10_000) for _ in range(20_000)]
    assert abs(sum(draws) / len(draws) - 100) < 3  # int() truncation costs ~0.5 on average


def test_shared_prefix_groups_share_their_prefix():
    workload = build_workload("shared-prefix:num_groups=2,prefix_len=50,num_requests=6,tail_len=5", 300)
    prompts = [r.prompt_token_ids for r in workload.requests]
    assert all(len(p) == 55 for p in prompts)
    assert prompts[0][:50] == prompts[2][:50] == prompts[4][:50]
    assert prompts[1][:50] == prompts[3][:50] != prompts[0][:50]
    assert len({tuple(p[50:]) for p in prompts}) == 6


def test_multi_turn_turns_extend_the_previous_turn_and_arrive_later():
    workload = build_workload("multi-turn:num_conversations=3,num_turns=3,system_len=20,user_len=4,"
                              "answer_len=6,turn_gap_s=0.25", 300)
    requests = workload.requests
    assert [r.arrival_time for r in requests] == [0.0] * 3 + [0.25] * 3 + [0.5] * 3
    for conversation in range(3):
        turns = [requests[turn * 3 + conversation].prompt_token_ids for turn in range(3)]
        assert [len(t) for t in turns] == [24, 34, 44]
        assert turns[1][:24] == turns[0] and turns[2][:34] == turns[1]
    assert requests[0].prompt_token_ids[:20] == requests[1].prompt_token_ids[:20], "one system prompt"
    assert requests[0].prompt_token_ids[20:] != requests[1].prompt_token_ids[20:]


def test_poisson_and_bursty_arrivals_are_ordered_at_the_rate():
    poisson = build_workload("skewed:num_requests=400,arrival=poisson,rate=10", 300)
    times = [r.arrival_time for r in poisson.requests]
    assert times == sorted(times) and times[0] > 0
    assert 400 / times[-1] == pytest.approx(10, rel=0.15)
    bursty = build_workload("skewed:num_requests=32,arrival=bursty,rate=10,burst_size=8", 300)
    assert len({r.arrival_time for r in bursty.requests}) == 4


def test_long_burst_and_repetitive_shapes():
    burst = build_workload("long-burst:num_long=2,long_len=300,num_short=6,short_len=10", 300)
    assert sorted(len(r.prompt_token_ids) for r in burst.requests) == [10] * 6 + [300] * 2
    rep = build_workload("repetitive:passage_len=40,num_requests=3", 300).requests[0].prompt_token_ids
    assert rep[40:] == rep[: len(rep) - 40]


@pytest.mark.parametrize("spec", ["nope", "skewed:num_requests", "skewed:bogus=1", "skewed:arrival=poisson"])
def test_bad_workload_specs_are_config_errors(spec):
    with pytest.raises(ConfigError):
        build_workload(spec, 300)


def test_percentiles_interpolate():
    assert percentiles(list(range(101))) == {"p50": 50, "p90": 90, "p99": 99}
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None}


def test_two_configs_side_by_side_with_json_and_plots(llama_checkpoint, tmp_path):
    base = EngineConfig().with_overrides({"engine.model": llama_checkpoint, "engine.max_model_len": 128})
    small = base.with_overrides({"engine.max_num_seqs": 2})
    options = BenchOptions(workload="skewed:num_requests=8,mean_prompt_len=16,mean_output_len=8,max_len=64",
                           repeats=2, slo=SLO(ttft_ms=1e9, tpot_ms=1e9), plots_dir=tmp_path / "plots",
                           rates=(50.0,))
    result = run_bench([("wide", base), ("narrow", small)], options)
    wide, narrow = (run["metrics"] for run in result["runs"])
    expected_tokens = result["workload"]["output_tokens"]
    for metrics in (wide, narrow):
        assert metrics["output_tokens"] == expected_tokens
        assert metrics["goodput_rps"] == pytest.approx(metrics["requests_per_s"])  # the SLO admits all
        assert metrics["slot_steps_used"] == expected_tokens  # one decode slot-step per generated token
        assert 0 < metrics["kv_utilization"] < 1
        assert metrics["ttft_ms"]["p50"] <= metrics["e2e_ms"]["p50"]
    assert narrow["steps"] > wide["steps"]  # two sequences at a time need more steps
    assert len(result["runs"][0]["repeats_output_tokens_per_s"]) == 2
    assert [p["rate"] for p in result["rate_sweep"]["wide"]] == [50.0]
    for path in result["plots"]:
        with open(path, "rb") as handle:
            assert handle.read(8) == b"\x89PNG\r\n\x1a\n"
    table = format_table(result)
    assert "wide" in table and "narrow" in table and "TTFT p50/p90/p99 ms" in table
    assert result["runs"][1]["changes"] == ["engine.max_num_seqs=2 (wide: 64)"]
    assert [w["kind"] for w in result["warnings"]] == []  # two at a time changes the order of admission
    for run in result["runs"]:
        records = run["requests"]
        assert len(records) == 8 and sum(r["output_tokens"] for r in records) == expected_tokens
        assert sum(r["preemptions"] for r in records) == run["metrics"]["preemptions"]
        assert all(r["ttft_ms"] <= r["e2e_ms"] and r["deadline_met"] is None for r in records)
    json.dumps(result)  # the --json output must serialise


def test_cli_bench_writes_json(llama_checkpoint, tmp_path):
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, "-m", "servelab.cli", "bench", "--model", llama_checkpoint,
         "--set", "engine.max_model_len=128", "--workload", "skewed:num_requests=4,mean_prompt_len=8,mean_output_len=4,max_len=32",
         "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    metrics = result["runs"][0]["metrics"]
    for key in ("output_tokens_per_s", "ttft_ms", "tpot_ms", "e2e_ms", "goodput_rps", "kv_waste_fraction",
                "prefix_hit_rate", "acceptance_rate", "slot_steps_used", "slot_steps_wasted", "preemptions"):
        assert key in metrics
    assert "output tokens/s" in proc.stdout
    records = result["runs"][0]["requests"]
    assert len(records) == 4 and records[0]["replica"] == 0 and records[0]["prompt_tokens"] >= 1
    assert result["warnings"] == []


def test_hf_baseline_column_runs_interleaved(llama_checkpoint):
    config = EngineConfig().with_overrides({"engine.model": llama_checkpoint, "engine.max_model_len": 128})
    options = BenchOptions(workload="skewed:num_requests=6,mean_prompt_len=12,mean_output_len=6,max_len=48",
                           repeats=2, baseline="hf", hf_batch_size=3)
    result = run_bench([("servelab", config)], options)
    baseline = result["baseline"]
    assert baseline["config"] == "hf-static"
    assert len(baseline["repeats_output_tokens_per_s"]) == 2
    assert baseline["metrics"]["output_tokens"] == result["workload"]["output_tokens"]
    assert "servelab / hf-static output tokens/s" in format_table(result)


def test_vllm_baseline_without_vllm_says_how_to_install(tmp_path):
    from servelab.bench.vllm_baseline import check_python

    with pytest.raises(ConfigError, match="install vLLM's CPU build in its own virtual environment"):
        check_python(None)
    with pytest.raises(ConfigError, match="does not exist"):
        check_python(str(tmp_path / "no-python"))
    with pytest.raises(ConfigError, match="cannot import vllm"):
        check_python(sys.executable)  # servelab's own environment has no vLLM


@pytest.mark.skipif(not os.environ.get("SERVELAB_VLLM_PYTHON"),
                    reason="vLLM is an optional peer: set SERVELAB_VLLM_PYTHON to its venv's python to run this")
def test_vllm_baseline_runs_the_same_workload(tmp_path):
    from servelab.bench.vllm_baseline import VllmBaseline
    from servelab.model.builtin import resolve

    vllm = VllmBaseline(os.environ["SERVELAB_VLLM_PYTHON"], str(resolve("builtin:tiny-random")), "float32",
                        256, 8, 2048)
    try:
        workload = build_workload("skewed:num_requests=4,max_len=128", 8192)
        result = vllm.run(workload)
        assert result["output_tokens"] == workload.num_output_tokens
        assert len(vllm.latency(16, 8, 2)["tpot_ms"]) == 2
    finally:
        vllm.close()


def test_conversations_extend_their_own_history_over_many_system_prompts():
    spec = ("conversations:num_system_prompts=5,system_len=16,num_conversations=40,num_turns=3,user_len=4,"
            "answer_len=6,output_len=2,conversation_rate=2,turn_gap_s=5,popularity=1.5")
    workload = build_workload(spec, 300)
    assert workload == build_workload(spec, 300)
    requests = workload.requests
    assert len(requests) == 120
    assert [r.arrival_time for r in requests] == sorted(r.arrival_time for r in requests)
    # Turn t of a conversation is turn t-1's prompt plus an answer and a user message, later.
    by_prefix = {}
    for r in requests:
        by_prefix.setdefault(tuple(r.prompt_token_ids[:20]), []).append(r)
    assert len(by_prefix) == 40
    for turns in by_prefix.values():
        assert [len(t.prompt_token_ids) for t in turns] == [20, 30, 40]
        assert turns[1].prompt_token_ids[:20] == turns[0].prompt_token_ids
        assert turns[2].prompt_token_ids[:30] == turns[1].prompt_token_ids
        assert turns[0].arrival_time < turns[1].arrival_time < turns[2].arrival_time
    # Five system prompts, the most popular first: weights 1, 1/2**1.5, ...
    systems = Counter(tuple(t[0].prompt_token_ids[:16]) for t in by_prefix.values())
    assert len(systems) <= 5 and systems.most_common(1)[0][1] >= 40 * 0.3
    starts = sorted(t[0].arrival_time for t in by_prefix.values())
    assert 40 / starts[-1] == pytest.approx(2, rel=0.4)


def test_shared_prefix_shuffle_draws_groups_at_random():
    cycled = build_workload("shared-prefix:num_groups=4,prefix_len=8,num_requests=40,tail_len=2", 300)
    shuffled = build_workload("shared-prefix:num_groups=4,prefix_len=8,num_requests=40,tail_len=2,shuffle=1", 300)
    group = lambda r: tuple(r.prompt_token_ids[:8])  # noqa: E731
    cycle = [group(r) for r in cycled.requests]
    assert cycle[:4] * 10 == cycle
    drawn = [group(r) for r in shuffled.requests]
    assert drawn != drawn[:4] * 10 and len(set(drawn)) == 4


def test_the_vllm_baseline_waits_for_the_machine_to_go_quiet(monkeypatch):
    """vLLM's engine keeps polling for a moment after each command: the next timing starts
    once the CPUs are idle, and never waits past the limit."""
    from servelab.bench import vllm_baseline

    readings = iter([(0, 0), (90, 100), (180, 200), (185, 300), (185, 400)])  # busy, busy, then idle
    monkeypatch.setattr(vllm_baseline, "_cpu_times", lambda: next(readings))
    monkeypatch.setattr(vllm_baseline.time, "sleep", lambda seconds: None)
    vllm_baseline.wait_until_idle()
    assert next(readings) == (185, 400), "returned at the first idle period, not before"

    always_busy = iter((100 * i, 100 * i) for i in range(10**6))
    monkeypatch.setattr(vllm_baseline, "_cpu_times", lambda: next(always_busy))
    clock = iter(range(10**6))
    monkeypatch.setattr(vllm_baseline.time, "monotonic", lambda: next(clock))
    vllm_baseline.wait_until_idle(limit_s=5.0)
    assert next(always_busy)[0] <= 100 * 8, "gave up at the limit"

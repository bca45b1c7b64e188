"""The cause the bench names for each SLO miss (servelab.bench.miss_causes), on tiny
simulated scenarios whose cause is known by construction."""

from __future__ import annotations

import json

import pytest

from servelab.bench.metrics import SLO
from servelab.bench.report import format_table
from servelab.bench.session import BenchOptions, run_bench
from servelab.config import EngineConfig


def _workload(tmp_path, requests: list[tuple[int, int, float]], **extra) -> str:
    """A file: workload of (prompt tokens, output tokens, arrival s)."""
    path = tmp_path / "w.jsonl"
    with open(path, "w") as handle:
        for number, (prompt_len, output_len, arrival) in enumerate(requests):
            tokens = [3 + (number * 7 + i) % 90 for i in range(prompt_len)]
            handle.write(json.dumps({"prompt_token_ids": tokens, "max_tokens": output_len, "arrival_time": arrival,
                                     **extra}) + "\n")
    return f"file:{path}"


def _run(config: dict, workload: str, slo: SLO) -> dict:
    options = BenchOptions(workload=workload, repeats=1, sim_accelerator="h100", slo=slo)
    result = run_bench([("policy", EngineConfig.from_dict(config))], options)
    return result


def test_short_requests_behind_a_huge_prompt_are_queued_behind_a_prefill(tmp_path):
    # One 6,000-token prompt at t=0, then eight short requests while it prefills.
    requests = [(6000, 4, 0.0)] + [(16, 8, 0.001 * (i + 1)) for i in range(8)]
    config = {"engine": {"max_num_seqs": 16, "max_model_len": 8192, "max_num_batched_tokens": 8192},
              "scheduler": {"name": "continuous"}}
    result = _run(config, _workload(tmp_path, requests), SLO(ttft_ms=15, tpot_ms=1000))
    (run,) = result["runs"]
    records = run["requests"]
    shorts = records[1:]
    assert all(r["missed"] == ["ttft"] and r["miss_cause"] == "behind_prefill" for r in shorts)
    assert all(r["miss_ms"]["behind_prefill"] > 0.5 * r["ttft_ms"] for r in shorts)
    assert records[0]["miss_cause"] == "slow_steps"  # its own prompt is the slow step
    misses = run["metrics"]["slo_misses"]
    assert misses == {"num_missed": 9, "causes": {"behind_prefill": 8, "slow_steps": 1}}
    assert "policy: 9 missed their SLO: 8 queued behind a prefill, 1 slow steps" in format_table(result)


def test_a_tight_kv_pool_misses_by_preemption(tmp_path):
    requests = [(64, 200, 0.0) for _ in range(8)]
    config = {"engine": {"max_num_seqs": 8, "max_model_len": 512, "block_size": 16, "num_kv_blocks": 40},
              "scheduler": {"name": "continuous"}}
    result = _run(config, _workload(tmp_path, requests), SLO(ttft_ms=1e6, tpot_ms=1e6))
    (run,) = result["runs"]
    records = run["requests"]
    fastest = min(r["e2e_ms"] for r in records)
    # Everyone should finish within 1.5x of the first to finish: the preempted ones cannot.
    workload = _workload(tmp_path, requests, deadline=1.5 * fastest / 1000)
    (run,) = _run(config, workload, SLO(ttft_ms=1e6, tpot_ms=1e6))["runs"]
    records = run["requests"]
    missed = [r for r in records if r["missed"]]
    assert len(missed) >= 3 and all(r["missed"] == ["deadline"] and r["miss_cause"] == "preempted" for r in missed)
    assert all(r["preemptions"] and r["discarded_tokens"] > 0 for r in missed)
    assert all(r["miss_ms"]["preempted"] > r["e2e_ms"] - 1000 * r["deadline_s"] for r in missed)
    assert all(r["miss_cause"] is None for r in records if not r["preemptions"])
    assert run["metrics"]["slo_misses"] == {"num_missed": len(missed), "causes": {"preempted": len(missed)}}


def test_a_long_job_under_shortest_job_first_is_starved(tmp_path):
    # One slot. A short request runs; a long one arrives, then short ones: SJF runs every
    # short one before the long one, which arrived before them.
    requests = [(16, 16, 0.0), (16, 400, 0.0005)] + [(16, 16, 0.001 + 0.0001 * i) for i in range(6)]
    config = {"engine": {"max_num_seqs": 1, "max_model_len": 512},
              "scheduler": {"name": "sjf", "aging_tokens_per_s": 0}}
    first = _run(config, _workload(tmp_path, requests), SLO(ttft_ms=1e6, tpot_ms=1e6))
    records = first["runs"][0]["requests"]
    assert records[1]["ttft_ms"] > max(r["e2e_ms"] for r in records[2:]) * 0.5  # it did wait for them
    slo = SLO(ttft_ms=records[2]["ttft_ms"] * 1.01, tpot_ms=1e6)
    (run,) = _run(config, _workload(tmp_path, requests), slo)["runs"]
    records = run["requests"]
    assert records[1]["missed"] == ["ttft"] and records[1]["miss_cause"] == "starved"
    assert records[1]["miss_ms"]["starved"] > 0.9 * (records[1]["ttft_ms"] - records[0]["e2e_ms"])
    assert all(r["miss_cause"] != "starved" for r in records[2:])


def test_the_same_workload_under_fcfs_starves_nobody(tmp_path):
    requests = [(16, 16, 0.0), (16, 400, 0.0005)] + [(16, 16, 0.001 + 0.0001 * i) for i in range(6)]
    config = {"engine": {"max_num_seqs": 1, "max_model_len": 512}, "scheduler": {"name": "continuous"}}
    (run,) = _run(config, _workload(tmp_path, requests), SLO(ttft_ms=50, tpot_ms=1e6))["runs"]
    records = run["requests"]
    # They waited for the one slot while the long job decoded.
    assert all(r["missed"] == ["ttft"] and r["miss_cause"] == "queued_full" for r in records[2:])
    assert all(r["miss_cause"] != "starved" for r in records)
    # With a bound no step could meet, no delay is to blame: the steps are too slow.
    (run,) = _run(config, _workload(tmp_path, requests), SLO(ttft_ms=0.001, tpot_ms=1e6))["runs"]
    assert run["requests"][0]["miss_cause"] == "slow_steps"


def test_met_requests_carry_no_cause_and_the_json_keys_are_there(tmp_path):
    requests = [(16, 8, 0.0), (16, 8, 0.01)]
    (run,) = _run({"engine": {"max_num_seqs": 4, "max_model_len": 512}}, _workload(tmp_path, requests),
                  SLO())["runs"]
    assert [(r["missed"], r["miss_cause"], r["miss_ms"]) for r in run["requests"]] == [([], None, None)] * 2
    assert run["metrics"]["slo_misses"] == {"num_missed": 0, "causes": {}}


def test_a_fleet_reads_each_request_from_its_own_replica(tmp_path):
    # Two replicas, round-robin: requests 0, 2, 4 go to replica 0 behind a huge prompt;
    # 1, 3, 5 to replica 1, which runs only short ones.
    requests = [(6000, 4, 0.0), (16, 8, 0.0)] + [(16, 8, 0.001 * (i + 1)) for i in range(4)]
    config = {"engine": {"max_num_seqs": 16, "max_model_len": 8192, "max_num_batched_tokens": 8192},
              "router": {"name": "round-robin"}}
    options = BenchOptions(workload=_workload(tmp_path, requests), repeats=1, sim_accelerator="h100",
                           slo=SLO(ttft_ms=15, tpot_ms=1000), replicas=2)
    (run,) = run_bench([("fleet", EngineConfig.from_dict(config))], options)["runs"]
    records = run["requests"]
    assert [r["replica"] for r in records] == [0, 1, 0, 1, 0, 1]
    assert [r["miss_cause"] for r in records] == ["slow_steps", None, "behind_prefill", None, "behind_prefill", None]


def test_a_real_run_names_a_cause_for_every_miss(llama_checkpoint, tmp_path):
    requests = [(96, 4, 0.0)] + [(8, 6, 0.002 * (i + 1)) for i in range(5)]
    config = EngineConfig.from_dict({"engine": {"model": llama_checkpoint, "max_model_len": 128, "max_num_seqs": 4}})
    options = BenchOptions(workload=_workload(tmp_path, requests), repeats=1, slo=SLO(ttft_ms=0.001, tpot_ms=1e6))
    (run,) = run_bench([("real", config)], options)["runs"]
    records = run["requests"]
    assert all(r["missed"] == ["ttft"] and r["miss_cause"] is not None for r in records)  # no step is that fast
    for r in records:  # what is charged lies within the window, arrival to first token
        assert 0 < sum(r["miss_ms"].values()) <= r["ttft_ms"] + 1e-6
    counts = run["metrics"]["slo_misses"]
    assert counts["num_missed"] == 6 and sum(counts["causes"].values()) == 6


def test_the_charges_of_hand_built_steps():
    """Request b arrives at 0.5 s while a's 100-token prompt runs (0-1 s), then prefills
    beside a's decode (1-1.1 s): 0.5 s behind a prefill, 0.1 s of its own step."""
    from servelab.bench.driver import RunRecord, StepTrace
    from servelab.bench.miss_causes import classify_misses
    from servelab.bench.per_request import request_records
    from servelab.outputs import CompletionOutput, RequestMetrics, RequestOutput

    def output(request_id, prompt_len, arrival, scheduled, first_token, finish):
        return RequestOutput(request_id, None, [5] * prompt_len, [CompletionOutput(0, [7, 7], "", "length")],
                             RequestMetrics(arrival, scheduled, first_token, finish))

    traces = (StepTrace(0.0, 1.0, 100, (), (("a", 100),), ()),
              StepTrace(1.0, 1.1, 11, ("a",), (("b", 10),), ()),
              StepTrace(1.1, 1.2, 1, ("b",), (), ()))
    record = RunRecord("x", 0.0, 1.2, [output("a", 100, 0.0, 0.0, 1.0, 1.1), output("b", 10, 0.5, 1.0, 1.1, 1.2)],
                       [], None, None, 0, 16, step_traces=(traces,))
    rows = request_records(record)
    a, b = classify_misses(record, rows, SLO(ttft_ms=150, tpot_ms=1000))  # b is 0.45 s over
    assert a == {"missed": ["ttft"], "cause": "slow_steps",
                 "seconds": {**dict.fromkeys(("preempted", "starved", "behind_prefill", "queued_full"), 0.0),
                             "slow_steps": 1.0}}
    assert b["missed"] == ["ttft"] and b["cause"] == "behind_prefill"
    assert b["seconds"]["behind_prefill"] == pytest.approx(0.5) and b["seconds"]["slow_steps"] == pytest.approx(0.1)
    # 0.511 s over: the 0.5 s it waited would not have saved it.
    _, b = classify_misses(record, rows, SLO(ttft_ms=89, tpot_ms=1000))
    assert b["cause"] == "slow_steps"

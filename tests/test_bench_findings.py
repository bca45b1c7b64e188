"""What `servelab bench` says beyond its table: per-request records in the JSON,
deadlines and request classes, and the warnings that a comparison means nothing
(identical per-request results, no measurable difference, a lopsided fleet)."""

from __future__ import annotations

import json

import pytest

from servelab.bench.comparison import comparison_warnings, config_changes
from servelab.bench.metrics import SLO
from servelab.bench.report import format_table
from servelab.bench.session import BenchOptions, run_bench
from servelab.bench.sim.fleet import SimFleet, fleet_metrics, run_fleet
from servelab.config import EngineConfig
from servelab.errors import ConfigError
from servelab.workload import Workload, build_workload

RECORD_KEYS = {"index", "request_id", "request_class", "arrival_s", "prompt_tokens", "output_tokens", "ttft_ms",
               "tpot_ms", "e2e_ms", "preemptions", "discarded_tokens", "replica", "prefix_hit_tokens", "deadline_s",
               "deadline_met", "missed", "miss_cause", "miss_ms"}


def _config(**sections) -> EngineConfig:
    data = {"engine": {"max_num_seqs": 8, "max_model_len": 1024}, **sections}
    return EngineConfig.from_dict(data)


def _sim(workload: str) -> BenchOptions:
    return BenchOptions(workload=workload, repeats=1, sim_accelerator="h100")


# ------------------------------------------------------------------ workloads


def test_deadline_options_give_classes_and_deadlines_without_changing_the_requests():
    plain = build_workload("fixed:num_requests=8,prompt_len=4,output_len=10", 100)
    spec = "fixed:num_requests=8,prompt_len=4,output_len=10,deadline_s=2,deadline_per_token_s=0.1," \
           "urgent_fraction=0.25,urgent_deadline_s=0.5"
    timed = build_workload(spec, 100)
    assert [r.prompt_token_ids for r in timed.requests] == [r.prompt_token_ids for r in plain.requests]
    classes = [r.request_class for r in timed.requests]
    assert classes.count("urgent") == 2 and classes.count("standard") == 6
    for r in timed.requests:
        assert r.deadline == pytest.approx((0.5 if r.request_class == "urgent" else 2.0) + 0.1 * 10)
    assert build_workload(spec, 100) == timed  # the seed chooses the urgent ones


def test_file_workloads_carry_deadlines_and_classes(tmp_path):
    workload = build_workload("fixed:num_requests=3,prompt_len=4,output_len=2,deadline_s=1.5", 100)
    path = tmp_path / "w.jsonl"
    workload.save(path)
    assert Workload.load(path).requests == workload.requests
    path.write_text(json.dumps({"prompt_token_ids": [5, 6], "max_tokens": 2, "deadline": 0.25,
                                "request_class": "chat"}) + "\n")
    (request,) = Workload.load(path).requests
    assert (request.deadline, request.request_class) == (0.25, "chat")


@pytest.mark.parametrize("line, message", [
    ({"prompt_token_ids": [5], "max_tokens": 2, "deadline": -1}, "deadline must be a number of seconds > 0"),
    ({"prompt_token_ids": [5], "max_tokens": 2, "deadline": "soon"}, "deadline must be"),
    ({"prompt_token_ids": [5], "max_tokens": 2, "request_class": 7}, "request_class must be a non-empty string"),
])
def test_bad_deadline_fields_name_the_line(tmp_path, line, message):
    path = tmp_path / "w.jsonl"
    path.write_text(json.dumps(line) + "\n")
    with pytest.raises(ConfigError, match=f"w.jsonl:1: {message}"):
        Workload.load(path)


@pytest.mark.parametrize("options, message", [
    ("deadline_s=0", "deadline_s must be a number > 0"),
    ("urgent_fraction=0.5", "urgent_fraction needs urgent_deadline_s"),
    ("urgent_fraction=2,urgent_deadline_s=1", "urgent_fraction must be in"),
    ("deadline_per_token_s=0.1", "deadline_per_token_s needs"),
])
def test_bad_deadline_options_are_config_errors(options, message):
    with pytest.raises(ConfigError, match=message):
        build_workload(f"fixed:num_requests=4,{options}", 100)


# ------------------------------------------------------------------ per-request records


def test_json_carries_a_record_per_request_with_deadlines_by_class():
    workload = "fixed:num_requests=12,prompt_len=64,output_len=8,deadline_s=10,urgent_fraction=0.5," \
               "urgent_deadline_s=0.06"
    result = run_bench([("default", _config())], _sim(workload))
    (run,) = result["runs"]
    records = run["requests"]
    assert len(records) == 12 and all(set(r) == RECORD_KEYS for r in records)
    for r in records:
        assert r["deadline_met"] == (r["e2e_ms"] <= 1000 * r["deadline_s"])
        assert r["ttft_ms"] <= r["e2e_ms"] and r["output_tokens"] == 8 and r["prompt_tokens"] == 64
    by_class = run["metrics"]["by_class"]
    assert set(by_class) == {"standard", "urgent"}
    assert by_class["standard"]["deadline_attainment"] == 1.0  # ten seconds is plenty
    urgent = [r for r in records if r["request_class"] == "urgent"]
    assert by_class["urgent"]["deadline_attainment"] == sum(r["deadline_met"] for r in urgent) / len(urgent) < 1
    seconds = run["metrics"]["seconds"]
    assert by_class["urgent"]["goodput_rps"] * seconds == pytest.approx(sum(r["deadline_met"] for r in urgent))
    table = format_table(result)
    assert "deadlines met" in table and "default by request class: standard 6 requests" in table
    json.dumps(result)


def test_records_count_prefix_hits_preemptions_and_discarded_tokens():
    # Two groups sharing a 256-token prefix, in a pool too small to run all at once.
    config = _config(allocator={"name": "radix"}, scheduler={"name": "continuous"})
    config = config.with_overrides({"engine.num_kv_blocks": 48, "engine.block_size": 16, "engine.max_model_len": 512})
    workload = "shared-prefix:num_groups=2,prefix_len=256,num_requests=8,tail_len=16,output_len=64"
    result = run_bench([("small", config)], _sim(workload))
    run = result["runs"][0]
    records = run["requests"]
    assert sum(r["preemptions"] for r in records) == run["metrics"]["preemptions"] > 0
    assert sum(r["discarded_tokens"] for r in records) == run["metrics"]["discarded_tokens"] > 0
    assert records[0]["prefix_hit_tokens"] == 0  # the first of its group finds nothing cached
    assert any(r["prefix_hit_tokens"] >= 256 for r in records[2:])


def test_tpot_keeps_its_fractions_of_a_millisecond():
    result = {"workload": {"spec": "s", "num_requests": 1, "prompt_tokens": 1, "output_tokens": 1},
              "runs": [{"config": "a", "metrics": {"tpot_ms": {"p50": 0.42, "p90": 0.5, "p99": 0.61, "mean": 0.45},
                                                   "ttft_ms": {"p50": 12.34, "p90": 250.0, "p99": 300.2}}}]}
    table = format_table(result)
    assert "0.42/0.50/0.61" in table and "12.3/250/300" in table


# ------------------------------------------------------------------ warnings


def test_a_change_with_no_effect_is_flagged_identical_and_named():
    base = _config(scheduler={"name": "continuous"})
    aging = base.with_overrides({"scheduler.priority_aging_s": 5.0})  # every request has one priority
    wider = base.with_overrides({"engine.max_num_seqs": 2})
    result = run_bench([("default", base), ("aging", aging), ("narrow", wider)],
                       _sim("fixed:num_requests=8,prompt_len=64,output_len=8"))
    kinds = [(w["kind"], w["configs"]) for w in result["warnings"]]
    assert kinds == [("identical", ["default", "aging"])]
    flags = {run["config"]: run["flags"] for run in result["runs"]}
    assert flags == {"default": ["identical"], "aging": ["identical"], "narrow": []}
    changes = {run["config"]: run["changes"] for run in result["runs"]}
    assert changes["default"] == []
    assert changes["aging"] == ["scheduler.priority_aging_s=5.0 (default: unset)"]
    assert changes["narrow"] == ["engine.max_num_seqs=2 (default: 8)"]
    table = format_table(result)
    assert "warning: configs 'default' and 'aging' produced identical per-request results" in table
    assert "narrow changes relative to default: engine.max_num_seqs=2 (default: 8)" in table


def test_same_metrics_is_flagged_when_only_the_order_differs():
    metrics = {"output_tokens": 8, "steps": 4, "preemptions": 0, "prefix_hit_rate": None}
    from servelab.bench.driver import RunRecord
    from servelab.outputs import CompletionOutput, RequestMetrics, RequestOutput

    def record(first_token_times):
        outputs = [RequestOutput(f"r{i}", None, [1], [CompletionOutput(0, [7], "", "length")],
                                 RequestMetrics(0.0, 0.0, t, t)) for i, t in enumerate(first_token_times)]
        return RunRecord("x", 0.0, 1.0, outputs, [], None, None, 0, 16)

    warnings = comparison_warnings(["default", "lifo"], [record([1.0, 2.0]), record([2.0, 1.0])],
                                   [metrics, dict(metrics)], simulated=False)
    assert [w["kind"] for w in warnings] == ["same_metrics"]
    assert "'lifo' equals 'default' on every metric" in warnings[0]["message"]
    assert comparison_warnings(["default", "lifo"], [record([1.0, 2.0]), record([2.0, 1.0])],
                               [metrics, {**metrics, "steps": 5}], simulated=False) == []


class _AllOnReplicaZero:
    """A tie-break bug: the least-loaded replica by a key that is always 0."""

    def route(self, request, replicas):
        return min(replicas, key=lambda r: 0).replica_id


def test_a_lopsided_fleet_is_flagged():
    config = _config(router={"name": "round-robin"})
    workload = build_workload("fixed:num_requests=32,prompt_len=64,output_len=4,arrival=poisson,rate=200", 1000)
    fine = SimFleet("round-robin", config, 4, "h100", "llama-3-8b")
    bad = SimFleet("all-on-zero", config, 4, "h100", "llama-3-8b")
    bad.router = _AllOnReplicaZero()
    records = [run_fleet(fleet, workload) for fleet in (fine, bad)]
    metrics = [fleet_metrics(r, SLO(), 4, name) for r, name in zip(records, ("round-robin", "all-on-zero"))]
    assert metrics[1]["fleet"]["requests_per_replica"] == [32, 0, 0, 0]
    warnings = comparison_warnings(["round-robin", "all-on-zero"], [r.run for r in records], metrics, True)
    assert [(w["kind"], w["configs"], w.get("replica")) for w in warnings] == [("lopsided", ["all-on-zero"], 0)]
    assert "4.0x its even share" in warnings[0]["message"]
    assert comparison_warnings(["all-on-zero"], [records[1].run], [metrics[1]], True, imbalance_factor=5) == []


def test_config_changes_name_removed_settings():
    first = EngineConfig.from_dict({"scheduler": {"name": "chunked-prefill", "priority_aging_s": 3.0}})
    second = EngineConfig.from_dict({"scheduler": {"name": "continuous"}})
    changes = config_changes([("a", first), ("b", second)])
    assert changes == {"a": [], "b": ["scheduler.name='continuous' (a: 'chunked-prefill')",
                                      "scheduler.priority_aging_s=unset (a: 3.0)"]}

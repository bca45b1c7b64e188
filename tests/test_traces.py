"""Published trace formats as bench workloads (servelab.traces): Mooncake's JSONL with
hash ids per prompt block and Azure's CSV, with time scaling and sub-sampling, replayed
through `servelab bench` simulated and real."""

from __future__ import annotations

import json

import pytest

from servelab.bench.session import BenchOptions, run_bench
from servelab.config import EngineConfig
from servelab.errors import ConfigError
from servelab.workload import build_workload

# Request 1 shares request 0's first two blocks, request 3 its first block; request 2
# shares nothing; request 4 repeats request 1 whole (a retry).
MOONCAKE = [
    {"timestamp": 1000, "input_length": 40, "output_length": 4, "hash_ids": [0, 1, 2]},
    {"timestamp": 1100, "input_length": 44, "output_length": 5, "hash_ids": [0, 1, 3]},
    {"timestamp": 1250, "input_length": 20, "output_length": 6, "hash_ids": [4, 5]},
    {"timestamp": 1600, "input_length": 30, "output_length": 3, "hash_ids": [0, 6]},
    {"timestamp": 2000, "input_length": 44, "output_length": 5, "hash_ids": [0, 1, 3]},
    {"timestamp": 2400, "input_length": 10, "output_length": 2, "hash_ids": [7]},
]
AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,30,4
2023-11-16 18:15:46.9305900,12,7
2023-11-16 18:15:47.1805900,25,3
2023-11-16 18:15:48.6805900,8,5
"""
BLOCK = 16  # hash_block_size: tokens a hash id stands for in the samples


@pytest.fixture
def mooncake(tmp_path):
    path = tmp_path / "mooncake.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in MOONCAKE))
    return path


@pytest.fixture
def azure(tmp_path):
    path = tmp_path / "azure.csv"
    path.write_text(AZURE)
    return path


def test_mooncake_arrivals_lengths_and_shared_blocks(mooncake):
    requests = build_workload(f"mooncake:{mooncake},hash_block_size={BLOCK}", 1000).requests
    assert [r.arrival_time for r in requests] == pytest.approx([0.0, 0.1, 0.25, 0.6, 1.0, 1.4])
    assert [len(r.prompt_token_ids) for r in requests] == [row["input_length"] for row in MOONCAKE]
    assert [r.max_tokens for r in requests] == [row["output_length"] for row in MOONCAKE]
    first, second, other, third, retry, _ = (r.prompt_token_ids for r in requests)
    assert first[: 2 * BLOCK] == second[: 2 * BLOCK] and first[2 * BLOCK :] != second[2 * BLOCK : 40]
    assert third[:BLOCK] == first[:BLOCK] and third[BLOCK:] != first[BLOCK:30]
    assert other[:BLOCK] != first[:BLOCK]
    assert retry == second
    assert len(set(first[:BLOCK])) > 1  # real draws, not one token repeated


def test_a_prompt_longer_than_its_blocks_is_filled_and_a_seed_changes_the_tokens(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"timestamp": 5, "input_length": 50, "output_length": 1, "hash_ids": [9]}) + "\n")
    (request,) = build_workload(f"mooncake:{path},hash_block_size={BLOCK}", 1000).requests
    assert len(request.prompt_token_ids) == 50
    (other,) = build_workload(f"mooncake:{path},hash_block_size={BLOCK},seed=1", 1000).requests
    assert other.prompt_token_ids[:BLOCK] != request.prompt_token_ids[:BLOCK]


def test_speedup_scales_the_gaps(mooncake):
    plain = build_workload(f"mooncake:{mooncake},hash_block_size={BLOCK}", 1000).requests
    fast = build_workload(f"mooncake:{mooncake},hash_block_size={BLOCK},speedup=4", 1000).requests
    assert [r.arrival_time for r in fast] == pytest.approx([r.arrival_time / 4 for r in plain])
    assert [r.prompt_token_ids for r in fast] == [r.prompt_token_ids for r in plain]


def test_every_first_and_fraction_sample_and_arrivals_start_at_the_first_kept(mooncake):
    spec = f"mooncake:{mooncake},hash_block_size={BLOCK}"
    every = build_workload(spec + ",every=2", 1000).requests
    assert [r.max_tokens for r in every] == [4, 6, 5]
    assert [r.arrival_time for r in every] == pytest.approx([0.0, 0.25, 1.0])
    first = build_workload(spec + ",every=2,first=2", 1000).requests
    assert [r.max_tokens for r in first] == [4, 6]
    tail = build_workload(spec + ",every=3", 1000).requests  # rows 0 and 3
    assert [r.arrival_time for r in tail] == pytest.approx([0.0, 0.6])
    half = [build_workload(spec + f",fraction=0.5,seed={seed}", 1000).requests for seed in range(4)]
    assert half[0] == build_workload(spec + ",fraction=0.5,seed=0", 1000).requests  # seeded
    assert len({tuple(r.max_tokens for r in sample) for sample in half}) > 1
    assert any(len(sample) < len(MOONCAKE) for sample in half)
    for sample in half:
        assert sample and sample[0].arrival_time == 0.0
        kept = {r.max_tokens for r in sample}
        assert kept <= {row["output_length"] for row in MOONCAKE}


def test_azure_arrivals_and_lengths(azure):
    requests = build_workload(f"azure:{azure}", 1000).requests
    assert [r.arrival_time for r in requests] == pytest.approx([0.0, 0.25, 0.5, 2.0])
    assert [len(r.prompt_token_ids) for r in requests] == [30, 12, 25, 8]
    assert [r.max_tokens for r in requests] == [4, 7, 3, 5]
    slow = build_workload(f"azure:{azure},speedup=0.5,first=3", 1000).requests
    assert [r.arrival_time for r in slow] == pytest.approx([0.0, 0.5, 1.0])


def test_traces_take_the_deadline_options(azure):
    requests = build_workload(f"azure:{azure},deadline_s=2,deadline_per_token_s=0.5", 1000).requests
    assert [r.deadline for r in requests] == pytest.approx([4.0, 5.5, 3.5, 4.5])


@pytest.mark.parametrize("spec, message", [
    ("mooncake:{dir}/missing.jsonl", "does not exist"),
    ("mooncake:", "needs a path"),
    ("mooncake:{mooncake},speedup=0", "speedup=0 is out of range"),
    ("mooncake:{mooncake},every=1.5", "every=1.5 is out of range"),
    ("mooncake:{mooncake},fraction=2", "fraction=2 is out of range"),
    ("mooncake:{mooncake},speed=2", "unknown option"),
    ("mooncake:{mooncake},first", "must be key=value"),
    ("azure:{mooncake}", "needs the columns"),
    ("mooncake:{bad}", "bad.jsonl:2: a Mooncake trace line needs"),
    ("mooncake:{mooncake},fraction=0.01,seed=3", "keeps no request"),
])
def test_bad_traces_and_options_are_config_errors(tmp_path, mooncake, spec, message):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(MOONCAKE[0]) + "\n" + json.dumps({"timestamp": 3, "input_length": 4}) + "\n")
    with pytest.raises(ConfigError, match=message):
        build_workload(spec.format(dir=tmp_path, mooncake=mooncake, bad=bad), 1000)


@pytest.mark.parametrize("allocator", ["radix", "hash"])
def test_repeated_hash_ids_hit_the_prefix_cache_in_a_simulated_run(mooncake, allocator):
    config = EngineConfig.from_dict({"engine": {"max_num_seqs": 4, "max_model_len": 256, "block_size": BLOCK},
                                     "allocator": {"name": allocator}})
    options = BenchOptions(workload=f"mooncake:{mooncake},hash_block_size={BLOCK}", repeats=1, sim_accelerator="h100")
    (run,) = run_bench([("prefix", config)], options)["runs"]
    hits = [r["prefix_hit_tokens"] for r in run["requests"]]
    assert hits[0] == 0 and hits[2] == 0 and hits[5] == 0  # nothing of theirs was seen before
    assert hits[1] >= 2 * BLOCK and hits[3] >= BLOCK and hits[4] >= 2 * BLOCK
    assert [r["arrival_s"] for r in run["requests"]] == pytest.approx([0.0, 0.1, 0.25, 0.6, 1.0, 1.4], abs=1e-6)


def test_traces_replay_through_a_real_run(llama_checkpoint, mooncake, azure):
    config = EngineConfig.from_dict({"engine": {"model": llama_checkpoint, "max_num_seqs": 4,
                                                "max_model_len": 128, "block_size": BLOCK},
                                     "allocator": {"name": "radix"}})
    for spec in (f"mooncake:{mooncake},hash_block_size={BLOCK},speedup=20", f"azure:{azure},speedup=20"):
        (run,) = run_bench([("real", config)], BenchOptions(workload=spec, repeats=1))["runs"]
        records = run["requests"]
        expected = build_workload(spec, 1000).requests
        assert [r["prompt_tokens"] for r in records] == [len(r.prompt_token_ids) for r in expected]
        assert [r["output_tokens"] for r in records] == [r.max_tokens for r in expected]
        for record, request in zip(records, expected):
            assert record["arrival_s"] >= request.arrival_time - 1e-6
        if spec.startswith("mooncake"):
            assert records[4]["prefix_hit_tokens"] >= 2 * BLOCK

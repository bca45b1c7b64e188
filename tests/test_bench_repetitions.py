"""`servelab bench` repetitions: independent of each other (empty prefix cache unless
--warm-cache), rotated so no config always goes first, one model for every config, and
the spread of the repetitions in the table."""

from __future__ import annotations

import pytest

from servelab.bench.metrics import SLO, summarize
from servelab.bench.report import format_table
from servelab.bench.repetitions import run_repetitions, warm_up
from servelab.bench.session import BenchOptions, _Engine, run_bench
from servelab.config import EngineConfig
from servelab.errors import ConfigError
from servelab.workload import build_workload

SHARED = "shared-prefix:num_groups=2,prefix_len=32,num_requests=4,tail_len=4,output_len=2"


def _caching_engines(checkpoint: str, names: tuple[str, ...] = ("cached",), allocator: str = "radix") -> list[_Engine]:
    config = EngineConfig().with_overrides({"engine.model": checkpoint, "engine.max_model_len": 64,
                                            "engine.block_size": 4, "allocator.name": allocator})
    return [_Engine(name, config, BenchOptions()) for name in names]


def _hit_rates(records) -> list[float]:
    return [summarize(record, SLO())["prefix_hit_rate"] for record in records]


@pytest.mark.parametrize("allocator", ["radix", "hash"])
def test_every_repetition_starts_from_an_empty_prefix_cache(llama_checkpoint, allocator):
    [engine] = _caching_engines(llama_checkpoint, allocator=allocator)
    workload = build_workload(SHARED, 200)
    warm_up([engine], workload, warm_cache=False)
    cold = _hit_rates(run_repetitions([engine], workload, 3, warm_cache=False)["cached"])
    # All four requests arrive at once and are admitted in one step, before anything is
    # cached: a hit could only come from an earlier run.
    assert cold == [0.0, 0.0, 0.0]
    warm = _hit_rates(run_repetitions([engine], workload, 2, warm_cache=True)["cached"])
    assert all(rate > cold[0] for rate in warm)  # the previous run's prefixes and tails hit too


def test_repetitions_rotate_which_config_goes_first(llama_checkpoint):
    engines = _caching_engines(llama_checkpoint, ("a", "b", "c"))
    records = run_repetitions(engines, build_workload(SHARED, 200), 3, warm_cache=False)
    for round_index in range(3):
        starts = {name: runs[round_index].start_time for name, runs in records.items()}
        assert min(starts, key=starts.get) == "abc"[round_index]


def test_configs_naming_different_models_are_refused(llama_checkpoint):
    one = EngineConfig().with_overrides({"engine.model": llama_checkpoint})
    other = one.with_overrides({"engine.model": "builtin:tiny"})
    with pytest.raises(ConfigError, match="different models.*--model"):
        run_bench([("one", one), ("other", other)], BenchOptions())


def test_the_table_shows_the_spread_of_the_repetitions(llama_checkpoint):
    config = EngineConfig().with_overrides({"engine.model": llama_checkpoint, "engine.max_model_len": 64})
    result = run_bench([("only", config)], BenchOptions(workload=SHARED, repeats=3))
    repeats = result["runs"][0]["repeats_output_tokens_per_s"]
    assert len(repeats) == 3
    [row] = [line for line in format_table(result).splitlines() if "min-max of 3 runs" in line]
    assert row.split()[-1] == f"{min(repeats):.1f}-{max(repeats):.1f}"

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
from servelab.interfaces import AllocatorContext, Sequence
from servelab.plugins.allocators.radix import RadixAllocator
from servelab.sampling_params import SamplingParams
from servelab.workload import build_workload

SHARED = "shared-prefix:num_groups=2,prefix_len=32,num_requests=4,tail_len=4,output_len=2"


def _radix_engines(checkpoint: str, names: tuple[str, ...] = ("radix",)) -> list[_Engine]:
    config = EngineConfig().with_overrides({"engine.model": checkpoint, "engine.max_model_len": 64,
                                            "engine.block_size": 4, "allocator.name": "radix"})
    return [_Engine(name, config, BenchOptions()) for name in names]


def _hit_rates(records) -> list[float]:
    return [summarize(record, SLO())["prefix_hit_rate"] for record in records]


def test_every_repetition_starts_from_an_empty_prefix_cache(llama_checkpoint):
    [engine] = _radix_engines(llama_checkpoint)
    workload = build_workload(SHARED, 200)
    warm_up([engine], workload, warm_cache=False)
    cold = _hit_rates(run_repetitions([engine], workload, 3, warm_cache=False)["radix"])
    # All four requests arrive at once and are admitted in one step, before anything is
    # cached: a hit could only come from an earlier run.
    assert cold == [0.0, 0.0, 0.0]
    warm = _hit_rates(run_repetitions([engine], workload, 2, warm_cache=True)["radix"])
    assert all(rate > cold[0] for rate in warm)  # the previous run's prefixes and tails hit too


def test_repetitions_rotate_which_config_goes_first(llama_checkpoint):
    engines = _radix_engines(llama_checkpoint, ("a", "b", "c"))
    records = run_repetitions(engines, build_workload(SHARED, 200), 3, warm_cache=False)
    for round_index in range(3):
        starts = {name: runs[round_index].start_time for name, runs in records.items()}
        assert min(starts, key=starts.get) == "abc"[round_index]


def test_reset_prefix_cache_drops_unheld_blocks_and_keeps_held_ones():
    allocator = RadixAllocator(None, AllocatorContext(num_blocks=8, block_size=2, max_model_len=16))

    def run(request_id: str, tokens: list[int]) -> Sequence:
        seq = Sequence(request_id, tokens, SamplingParams(), 0.0)
        seq.num_computed_tokens = allocator.match_prefix(seq)
        assert allocator.allocate(request_id, len(tokens))
        seq.num_computed_tokens = len(tokens)
        allocator.cache_blocks(seq)
        return seq

    run("done", [1, 2, 3, 4, 5])
    allocator.free("done")  # its two full blocks stay cached, unheld
    held = run("running", [7, 8, 9, 10, 11])
    allocator.reset_prefix_cache()
    stats = allocator.stats()
    assert stats.num_free_blocks == 8 - 3  # only the running sequence's three blocks are out
    assert allocator.block_table("running") == allocator.block_table(held.request_id)
    again = Sequence("again", [1, 2, 3, 4, 5], SamplingParams(), 0.0)
    assert allocator.match_prefix(again) == 0  # the finished prefix is gone
    allocator.free("again")
    still = Sequence("still", [7, 8, 9, 10, 11], SamplingParams(), 0.0)
    assert allocator.match_prefix(still) == 4  # the running one's cached blocks stay


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

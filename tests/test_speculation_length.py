"""Dynamic speculation length: the per-step draft budgets are the optimum of the cost
model they state (against a brute-force search), turn down as the batch grows and as
acceptance falls, recover when drafting stops, and are configured for every drafter
with clear errors."""

from __future__ import annotations

import itertools

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

import servelab
from servelab import LLM, ConfigError, SamplingParams
from servelab.plugin_types import DrafterPlugin
from servelab.speculation_length import DynamicLength, SpeculationLengthOptions, split_length_options


def dynamic(**options) -> DynamicLength:
    return DynamicLength(SpeculationLengthOptions(dynamic_length=True, **options))


def rate(budgets: dict[str, int], acceptance: dict[str, float], overhead: float) -> float:
    """Expected tokens per unit of step cost: sum over sequences of 1 + p + ... + p^k, over
    overhead + tokens computed."""
    expected = sum(sum(acceptance[s] ** j for j in range(k + 1)) for s, k in budgets.items())
    return expected / (overhead + sum(1 + k for k in budgets.values()))


@settings(max_examples=80, deadline=None, derandomize=True)
@given(history=st.lists(st.tuples(st.integers(1, 4), st.integers(0, 4)), min_size=3, max_size=3),
       rooms=st.lists(st.integers(0, 3), min_size=1, max_size=3), overhead=st.sampled_from([0.0, 2.0, 16.0, 200.0]))
def test_budgets_are_the_cost_models_optimum(history, rooms, overhead):
    length = dynamic(dynamic_overhead_tokens=overhead, dynamic_decay=1.0)
    ids = [f"s{i}" for i in range(len(rooms))]
    for seq_id, (drafts, accepted) in zip(ids, history):
        length.observe(seq_id, drafts, min(accepted, drafts))
    acceptance = {seq_id: length.acceptance(seq_id) for seq_id in ids}
    room = dict(zip(ids, rooms))
    got = length.budgets(room)
    assert all(0 <= got[s] <= room[s] for s in ids)
    best = max(rate(dict(zip(ids, ks)), acceptance, overhead)
               for ks in itertools.product(*(range(r + 1) for r in rooms)))
    assert rate(got, acceptance, overhead) == pytest.approx(best)


def test_speculation_turns_down_as_the_batch_grows_and_acceptance_falls():
    length = dynamic(dynamic_overhead_tokens=16.0)
    for i in range(16):
        length.observe(f"s{i}", 4, 3)  # p = 0.75-ish for everyone
    one = length.budgets({"s0": 4})
    many = length.budgets({f"s{i}": 4 for i in range(16)})
    assert one["s0"] == 4
    assert 0 < sum(many.values()) / 16 < 4
    low = dynamic(dynamic_overhead_tokens=16.0)
    for _ in range(5):
        low.observe("s0", 4, 0)
    assert low.budgets({"s0": 4})["s0"] < one["s0"]
    for i in range(16):
        low.observe(f"t{i}", 4, 0)
    assert sum(low.budgets({f"t{i}": 4 for i in range(16)}).values()) == 0


def test_a_sequence_that_stopped_drafting_tries_again():
    length = dynamic(dynamic_overhead_tokens=4.0)
    for _ in range(4):
        length.observe("s", 4, 0)
    assert length.budgets({"s": 4})["s"] == 0
    steps = 0
    while length.budgets({"s": 4})["s"] == 0:  # decay pulls the estimate back towards the prior
        steps += 1
        assert steps < 100, "never drafts again"
    assert steps > 2


def test_every_drafter_takes_the_dynamic_keys_and_bad_ones_are_named():
    options, rest = split_length_options({"dynamic_length": True, "dynamic_overhead_tokens": 8, "max_ngram": 3})
    assert options.dynamic_length and options.dynamic_overhead_tokens == 8 and rest == {"max_ngram": 3}
    with pytest.raises(ConfigError, match="unknown option \\[drafter\\] 'dynamic_lenght'.*dynamic_length"):
        split_length_options({"dynamic_lenght": True})
    with pytest.raises(ConfigError, match="dynamic_decay must be in \\(0, 1\\]"):
        SpeculationLengthOptions(dynamic_decay=0)
    with pytest.raises(ConfigError, match="dynamic_length must be true or false"):
        LLM("builtin:tiny", config={"drafter": {"name": "ngram", "dynamic_length": "yes"}})


class _Wrong:
    """A drafter whose drafts greedy verification rejects (all but chance hits)."""

    def __init__(self, options, context):
        self.vocab_size = context.vocab_size

    def propose(self, seqs):
        return {seq.request_id: [(seq.output_token_ids[-1] if seq.output_token_ids else 0) ^ 1] * 4 for seq in seqs}


@pytest.mark.parametrize("dynamic_length", [False, True])
def test_a_drafter_that_is_always_wrong_drafts_little_with_dynamic_length(dynamic_length):
    class Plugin:
        @servelab.hookimpl
        def servelab_register_drafters(self):
            return [DrafterPlugin(name="wrong", factory=_Wrong, contract_version=2)]

    registry = servelab.PluginRegistry.from_entry_points()
    registry.register(Plugin())
    llm = LLM("builtin:tiny", config={"drafter": {"name": "wrong", "dynamic_length": dynamic_length}},
              registry=registry, max_model_len=256)
    plain = LLM("builtin:tiny", max_model_len=256)
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    out = llm.generate(["import os\n", "The "], params)
    assert [o.token_ids for o in out] == [o.token_ids for o in plain.generate(["import os\n", "The "], params)]
    stats = llm.engine.speculation_stats()
    # Static: 4 drafts at nearly every one of the ~96 steps (fewer near max_tokens).
    assert stats.num_draft_tokens < 96 if dynamic_length else stats.num_draft_tokens > 300

"""What a plugin author reaches for: the accepted-tokens callback, a request's deadline,
a router's session key, the harness's explicit clock and options, the contracts extra."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

import servelab
from servelab import LLM, PluginRegistry, RequestError, SamplingParams
from servelab.interfaces import AcceptingDrafter, RouteRequest
from servelab.plugin_types import DrafterPlugin
from servelab.testing import SchedulerHarness, make_allocator
from servelab.kit import ContinuousScheduler
from servelab_sjf.lookup import LookupOptions, RepeatLookupDrafter

ROOT = Path(__file__).resolve().parents[1]


class RecordingLookup(RepeatLookupDrafter):
    def __init__(self, options, context):
        super().__init__(options, context)
        self.calls = []

    def accepted(self, request_id, token_ids):
        self.calls.append((request_id, list(token_ids)))


def test_an_accepting_drafter_hears_every_verified_draft(servelab_tiny_checkpoint):
    class Plugin:
        @staticmethod
        @servelab.hookimpl
        def servelab_register_drafters():
            return [DrafterPlugin(name="recording", factory=RecordingLookup, options=LookupOptions,
                                  contract_version=2)]

    registry = PluginRegistry.from_entry_points()
    registry.register(Plugin)
    llm = LLM(servelab_tiny_checkpoint, max_model_len=128, registry=registry, **{"drafter.name": "recording"})
    assert isinstance(llm.engine.speculator.drafter, AcceptingDrafter)
    prompt = [7, 8, 9, 10] * 6
    llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    calls = llm.engine.speculator.drafter.calls
    stats = llm.engine.speculation_stats()
    assert calls and all(request_id == "req-0" for request_id, _ in calls)
    assert sum(len(tokens) for _, tokens in calls) == stats.num_accepted_tokens


@pytest.mark.parametrize("bad", [0, -1.5, float("inf"), True, "soon"])
def test_a_deadline_is_a_positive_number_of_seconds(bad):
    assert SamplingParams(deadline=2.5).deadline == 2.5 and SamplingParams().deadline is None
    with pytest.raises(RequestError, match="deadline must be a number of seconds > 0"):
        SamplingParams(deadline=bad)


def test_policies_read_the_deadline_through_the_harness():
    class EarliestDeadlineFirst(ContinuousScheduler):
        def rank(self, seq):
            return (seq.arrival_time + (seq.params.deadline or float("inf")),)

    harness = SchedulerHarness(lambda context: EarliestDeadlineFirst(None, context), make_allocator("paged", 32, 4, 32),
                               block_size=4, max_num_seqs=1, max_num_batched_tokens=32, max_model_len=32)
    harness.add(4, params=SamplingParams(max_tokens=2, deadline=30.0), request_id="relaxed")
    harness.add(4, params=SamplingParams(max_tokens=2, deadline=1.0), request_id="urgent")
    harness.add(4, params=SamplingParams(max_tokens=2), request_id="whenever", arrival_time=-5.0)
    harness.run()
    assert harness.first_scheduled == ["urgent", "relaxed", "whenever"]
    assert harness.now == 0.0, "the clock moves only when told (seconds_per_step, or setting now)"
    with pytest.raises(TypeError, match="contradict"):
        harness.add(4, max_tokens=3, params=SamplingParams(max_tokens=2))


def test_route_requests_carry_an_optional_session():
    assert RouteRequest("r", [1, 2]).session is None
    assert RouteRequest("r", [1, 2], session="user-7").session == "user-7"


def test_the_contracts_extra_is_light():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert sorted(spec.split(">")[0] for spec in extras["contracts"]) == ["hypothesis", "pytest"]

"""The simulator's stand-ins for the model runner and the wall clock."""

from __future__ import annotations

from typing import Any

import attrs
import torch

from servelab.bench.sim.cost_model import CostModel
from servelab.interfaces import KVAllocator, Runner, StepPlan, sampling_rows


class VirtualClock:
    """Seconds of simulated time; only the simulated runner moves it forward."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def advance_to(self, when: float) -> None:
        self.now = max(self.now, when)


@attrs.frozen
class SimInputs:
    query_lens: list[int]
    context_lens: list[int]
    sampled_seq_rows: list[int]
    num_logits_rows: list[int]  # per sampled sequence: 1 + its scheduled drafts
    prompt_logits: tuple = ()  # the simulator scores no prompts


def plan_shape(plan: StepPlan) -> SimInputs:
    """What the cost model needs from a plan: tokens and context per sequence, sampled rows."""
    scheduled = plan.scheduled
    query_lens = [num_new for _, num_new in scheduled]
    context_lens = [seq.num_computed_tokens + num_new for seq, num_new in scheduled]
    sampled, num_rows = sampling_rows(plan)
    return SimInputs(query_lens, context_lens, sampled, num_rows)


class SimRunner(Runner):
    """Costs each step with the roofline and returns all-zero logits over a one-token
    vocabulary, so greedy sampling yields token 0 and every policy runs unchanged."""

    device = torch.device("cpu")
    supports_prompt_logprobs = False
    vocab_size = 1

    def __init__(self, cost_model: CostModel, clock: VirtualClock) -> None:
        self.cost_model = cost_model
        self.clock = clock
        self.total_seconds = 0.0

    def prepare(self, plan: StepPlan, allocator: KVAllocator, prompt_logprobs: bool = False) -> SimInputs:
        return plan_shape(plan)

    def execute(self, inputs: SimInputs) -> torch.Tensor:
        cost = self.cost_model.step(inputs.query_lens, inputs.context_lens, len(inputs.sampled_seq_rows))
        self.clock.advance(cost.seconds)
        self.total_seconds += cost.seconds
        return torch.zeros(sum(inputs.num_logits_rows), 1)

    def execute_with_hidden(self, inputs: SimInputs) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError("the simulator has no hidden states: drafters that read them cannot be simulated")

    def copy_blocks(self, copies: Any) -> None:
        """Copy-on-write copies cost nothing worth modelling here."""

    def close(self) -> None:
        """Nothing to release."""

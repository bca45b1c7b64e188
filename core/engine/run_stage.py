"""The run stage: a plan's KV moves and copies, the runner's inputs, the forward; what
the forward produced comes back as one record, `StepRun`, which the sampling, verify
and update stages read.

The runner's Protocol keeps its three forwards (`execute`, `execute_with_hidden`,
`FeatureRunner.execute_with_features`: runner authors and the tensor-parallel and
simulated runners implement them); this stage picks the one the drafter needs, once.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from servelab.interfaces import StepPlan


@attrs.frozen
class StepRun:
    """One step's forward: the plan, the inputs the runner prepared, and its outputs."""

    plan: StepPlan
    inputs: Any  # servelab.interfaces.StepInputs: which rows sample, how many logits rows each
    logits: torch.Tensor  # float32 [sampling rows (+ scored prompt rows), vocab]
    hidden: torch.Tensor | None = None  # final-normed hidden states of the logits rows (HiddenStateDrafter)
    features: torch.Tensor | None = None  # residual streams at every input row (FeatureDrafter)


class RunStage:
    def __init__(self, runner: Any, allocator: Any, wants_hidden: bool = False,
                 feature_layers: tuple[int, ...] = ()) -> None:
        self.runner = runner
        self.allocator = allocator
        self.wants_hidden = wants_hidden
        self.feature_layers = feature_layers

    def prepare(self, plan: StepPlan, now: float, scores_prompts: bool) -> Any:
        """Record first scheduling, move and copy the plan's blocks, then the runner's
        inputs (with prompt rows when `scores_prompts`)."""
        self.move_blocks(plan)
        for seq, _ in plan.scheduled:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
                seq.num_cached_tokens = seq.num_computed_tokens  # what the prefix cache held
        if scores_prompts:
            return self.runner.prepare(plan, self.allocator, prompt_logprobs=True)
        return self.runner.prepare(plan, self.allocator)

    def move_blocks(self, plan: StepPlan) -> None:
        """The plan's moves between KV tiers, then its copy-on-write copies."""
        if plan.kv_moves:
            self.runner.move_blocks(plan.kv_moves)
        if plan.block_copies:
            self.runner.copy_blocks(plan.block_copies)

    def execute(self, plan: StepPlan, inputs: Any) -> StepRun:
        if self.wants_hidden:
            logits, hidden = self.runner.execute_with_hidden(inputs)
            return StepRun(plan, inputs, logits, hidden=hidden)
        if self.feature_layers:
            logits, features = self.runner.execute_with_features(inputs, self.feature_layers)
            return StepRun(plan, inputs, logits, features=features)
        return StepRun(plan, inputs, self.runner.execute(inputs))

    def submit(self, inputs: Any) -> Any:
        """Start a plan's forward on a runner that keeps batches in flight (BatchQueueRunner)."""
        return self.runner.submit(inputs)

    def complete(self, plan: StepPlan, inputs: Any, ticket: Any) -> StepRun:
        """The forward of the oldest batch submitted, as `execute` returns it."""
        logits, hidden = self.runner.complete(ticket)
        return StepRun(plan, inputs, logits, hidden=hidden if self.wants_hidden else None)

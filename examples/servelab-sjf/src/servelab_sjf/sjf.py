"""Shortest job first on the policy kit: continuous batching whose queues are ordered by
expected work (prompt + max_tokens), aged so long jobs cannot starve; the worst-ranked
running sequence (the longest job) is the one preempted when KV runs out."""

from __future__ import annotations

import attrs

from servelab.kit import ContinuousScheduler
from servelab.options import non_negative_number


@attrs.frozen(kw_only=True)
class SJFOptions:
    # Tokens of expected work one second of waiting is worth; 0 = pure SJF (long jobs may starve).
    aging_tokens_per_s: float = attrs.field(default=50.0, validator=non_negative_number("scheduler"))


class SJFScheduler(ContinuousScheduler):
    name = "sjf"

    def __init__(self, options, context):
        super().__init__(options or SJFOptions(), context)

    def rank(self, seq):  # fixed at arrival: every waiting request ages at the same rate
        expected = len(seq.prompt_token_ids) + seq.params.max_tokens
        return seq.priority, expected + self.options.aging_tokens_per_s * seq.arrival_time

"""Shortest job first on the policy kit: continuous batching whose queues are ordered by
expected work (prompt + max_tokens), aged so long jobs cannot starve; the worst-ranked
running sequence (the longest job) is the one preempted when KV runs out.

Its options extend the kit's (`ContinuousOptions`), so `priority_aging_s`, `preemption`
and the rest keep their meaning and their one default: a priority level is worth
`priority_aging_s` seconds of waiting, and a second `aging_tokens_per_s` tokens of work."""

from __future__ import annotations

import attrs

from servelab.kit import ContinuousOptions, ContinuousScheduler
from servelab.options import non_negative_number


@attrs.frozen(kw_only=True)
class SJFOptions(ContinuousOptions):
    # Tokens of expected work one second of waiting is worth; 0 = pure SJF (long jobs may starve).
    aging_tokens_per_s: float = attrs.field(default=50.0, validator=non_negative_number("scheduler"))


class SJFScheduler(ContinuousScheduler):
    name = "sjf"
    options_class = SJFOptions

    def rank(self, seq):  # fixed at arrival: every waiting request ages at the same rate
        expected = len(seq.prompt_token_ids) + seq.params.max_tokens
        waited = seq.arrival_time + seq.priority * self.options.priority_aging_s  # priority, aged as the kit ages it
        if self.options.aging_tokens_per_s and self.options.priority_aging_s:
            return (expected + self.options.aging_tokens_per_s * waited,)
        return seq.priority, expected + self.options.aging_tokens_per_s * seq.arrival_time

"""What the engine hands back: finished requests and per-step reports."""

from __future__ import annotations

import attrs

from servelab.interfaces import AllocatorStats, SchedulerStats


@attrs.frozen
class RequestMetrics:
    """Per-request timestamps (seconds on the engine's clock)."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finish_time: float | None
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        """Time to first token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        if self.finish_time is None:
            return None
        return self.finish_time - self.arrival_time


@attrs.frozen
class CompletionOutput:
    """One completion of a request."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "stop", "length" or "abort"


@attrs.frozen
class RequestOutput:
    """A finished request: its prompt, generated tokens and text, and timings."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: RequestMetrics
    finished: bool = True

    @property
    def token_ids(self) -> list[int]:
        """Generated token ids of the first completion."""
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


@attrs.frozen
class StepReport:
    """What one engine step did, for observers (metrics, tracing, benchmarks)."""

    step_index: int
    num_seqs: int  # sequences in the batch
    num_scheduled_tokens: int
    num_preempted: int
    num_finished: int
    schedule_seconds: float  # scheduler + allocator
    prepare_seconds: float  # building the batch's input tensors
    forward_seconds: float  # model forward
    sample_seconds: float
    update_seconds: float  # appending tokens, stop checks, retiring
    allocator_stats: AllocatorStats
    scheduler_stats: SchedulerStats

    @property
    def overhead_seconds(self) -> float:
        """Engine time outside the model forward and sampling."""
        return self.schedule_seconds + self.prepare_seconds + self.update_seconds

"""What the engine hands back: finished requests and per-step reports."""

from __future__ import annotations

import attrs

from typing import Any, Callable, Sequence as Seq

from servelab.interfaces import AllocatorStats, SchedulerStats, Sequence


@attrs.frozen
class RequestMetrics:
    """Per-request timestamps (seconds on the engine's clock)."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finish_time: float | None
    num_preemptions: int = 0
    # Speculative decoding, over all completions: drafts verified, drafts accepted, and
    # target steps that produced tokens (prefill included).
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_sampling_steps: int = 0
    # Computed tokens recompute preemptions threw away, over all completions.
    num_discarded_tokens: int = 0
    # Prompt tokens found in the prefix cache when the request was first scheduled.
    num_cached_tokens: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

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

    @property
    def queue_time(self) -> float | None:
        """Arrival to first scheduled step."""
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time


@attrs.frozen
class Logprob:
    """A token's log-probability, its rank in its distribution (1 is the most likely)
    and its text (filled in when the request finishes, or by the server as it streams)."""

    logprob: float
    rank: int
    decoded_token: str | None = None


# {token id: Logprob} at one position: the chosen token and the top-k alternatives (as vLLM).
PositionLogprobs = dict[int, Logprob]


@attrs.frozen
class CompletionOutput:
    """One completion of a request.

    `logprobs` (when SamplingParams.logprobs was set) holds one {token id: Logprob} per
    generated token: the token itself and the k most likely alternatives."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "stop", "length", "abort" or "error"
    logprobs: list[PositionLogprobs] | None = None
    # finish_reason "stop": the stop string or stop token id that ended it (None: EOS)
    stop_reason: int | str | None = None


@attrs.frozen
class RequestOutput:
    """A finished request: its prompt, generated tokens and text, and timings.

    `outputs` holds one CompletionOutput per completion (SamplingParams.n), by index;
    `token_ids`, `text` and `finish_reason` are the first one's. `prompt_logprobs`
    (SamplingParams.prompt_logprobs) holds one {token id: Logprob} per prompt token, None
    for the first. `error` says why a request with finish_reason "error" failed.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: RequestMetrics
    finished: bool = True
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    error: str | None = None

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

    @property
    def mean_tokens_per_step(self) -> float | None:
        """Generated tokens per target step that produced any (1.0 without speculation)."""
        steps = self.metrics.num_sampling_steps
        return sum(len(o.token_ids) for o in self.outputs) / steps if steps else None

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first, of the first completion (seconds);
        None with fewer than two tokens."""
        metrics, num_tokens = self.metrics, len(self.token_ids)
        if num_tokens < 2 or metrics.finish_time is None or metrics.first_token_time is None:
            return None
        return (metrics.finish_time - metrics.first_token_time) / (num_tokens - 1)


def request_output(request_id: str, prompt: str | None, seqs: Seq[Sequence],
                   decode: Callable[[list[int]], str]) -> RequestOutput:
    """A finished request's output from its sequences, one per completion (n of them)."""
    first = seqs[0]
    errors = [s.error for s in seqs if s.error is not None]
    first_token_times = [s.first_token_time for s in seqs if s.first_token_time is not None]
    finish_times = [s.finish_time for s in seqs if s.finish_time is not None]
    texts: dict[int, str] = {}  # token id -> its text, for every logprob of the request
    return RequestOutput(
        request_id=request_id,
        prompt=prompt,
        prompt_token_ids=first.prompt_token_ids,
        outputs=[_completion(s, decode, texts) for s in seqs],
        metrics=RequestMetrics(first.arrival_time, first.first_scheduled_time, min(first_token_times, default=None),
                               max(finish_times, default=None), sum(s.num_preemptions for s in seqs),
                               sum(s.num_draft_tokens for s in seqs), sum(s.num_accepted_tokens for s in seqs),
                               sum(s.num_sampling_steps for s in seqs),
                               num_discarded_tokens=sum(s.num_discarded_tokens for s in seqs),
                               num_cached_tokens=first.num_cached_tokens),
        prompt_logprobs=with_token_text(first.prompt_logprobs, decode, texts),
        error=errors[0] if errors else None,
    )


def _completion(seq: Sequence, decode: Callable[[list[int]], str], texts: dict[int, str]) -> CompletionOutput:
    logprobs = seq.logprobs[: len(seq.output_token_ids)] if seq.logprobs is not None else None
    return CompletionOutput(seq.completion_index, list(seq.output_token_ids), completion_text(seq, decode),
                            seq.finish_reason, with_token_text(logprobs, decode, texts), seq.stop_reason)


def completion_text(seq: Sequence, decode: Callable[[list[int]], str]) -> str:
    """The output's text: cut at the stop string that ended it, and without the text of
    the token that ended it (EOS or a stop token) unless include_stop_str_in_output."""
    if seq.stop_text is not None:
        return seq.stop_text
    tokens = seq.output_token_ids
    if (seq.finish_reason == "stop" and tokens and not seq.params.include_stop_str_in_output
            and seq.stop_reason is not None):
        return decode(tokens[:-1])
    return decode(tokens)


def with_token_text(positions: Seq[PositionLogprobs | None] | None, decode: Callable[[list[int]], str],
                    texts: dict[int, str] | None = None) -> list[PositionLogprobs | None] | None:
    """Logprobs with each token's text filled in, each token id decoded once (`texts`
    caches them across calls). The one place token text is made, for the engine's
    outputs and the server's streamed logprobs alike."""
    if positions is None:
        return None
    texts = {} if texts is None else texts
    filled: list[PositionLogprobs | None] = []
    for position in positions:
        if position is None:
            filled.append(None)
            continue
        for token_id in position:
            if token_id not in texts:
                texts[token_id] = decode([token_id])
        filled.append({t: attrs.evolve(lp, decoded_token=texts[t]) for t, lp in position.items()})
    return filled


@attrs.frozen
class StepReport:
    """What one engine step did, for observers (metrics, tracing, benchmarks).

    The *_seconds stage timings are wall-clock time (time.perf_counter), also when the
    engine runs on a virtual clock (the simulator, whose forward is a cost model).
    """

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
    num_draft_tokens: int = 0  # drafts verified this step
    num_accepted_tokens: int = 0
    tier_stats: Any = None  # servelab.interfaces.TierStats with a host KV tier ([kv_offload]), else None

    @property
    def overhead_seconds(self) -> float:
        """Engine time outside the model forward and sampling."""
        return self.schedule_seconds + self.prepare_seconds + self.update_seconds


@attrs.define
class RequestEvent:
    """What one step did for one sequence: its new tokens and their logprobs, the prompt's
    logprobs once scored (on completion 0's), and the request's output once it finished.

    The one shape a token has between the sampler and the server's text: the sampling and
    verify stages make it, the update stage cuts it at the sequence's stop and adds the
    logprobs, and it travels as it is in a `StepResult`, across a process or a Ray actor,
    through the server's stream buffer to its detokenizer, which adds the text deltas
    (`deltas`). The server sets `error` when the engine failed the request."""

    new_token_ids: tuple[int, ...] = ()
    new_logprobs: tuple[PositionLogprobs, ...] = ()  # SamplingParams.logprobs: one per new token
    prompt_logprobs: tuple[PositionLogprobs | None, ...] = ()  # SamplingParams.prompt_logprobs, once scored
    output: RequestOutput | None = None  # set once, when the request finished or was aborted
    error: str | None = None  # the engine failed; the request is gone
    deltas: tuple[Any, ...] = ()  # the request's text deltas, when it registered a decode function
    decode_error: str | None = None  # its decode function failed

    @property
    def is_last(self) -> bool:
        return self.output is not None or self.error is not None


def merge_events(earlier: RequestEvent, later: RequestEvent) -> RequestEvent:
    """Two consecutive events of one key as one (`later` may end the request)."""
    return RequestEvent(
        new_token_ids=earlier.new_token_ids + later.new_token_ids,
        new_logprobs=earlier.new_logprobs + later.new_logprobs,
        prompt_logprobs=later.prompt_logprobs or earlier.prompt_logprobs,
        output=later.output if later.output is not None else earlier.output,
        error=later.error if later.error is not None else earlier.error,
        deltas=earlier.deltas + later.deltas,
        decode_error=later.decode_error if later.decode_error is not None else earlier.decode_error)


@attrs.frozen
class StepResult:
    """What a step produced: an event per sequence with new tokens (or prompt logprobs), and
    the requests it finished.

    `events` is keyed by sequence id: the request id, or "{request_id}#{i}" for completion
    i > 0 of a request with SamplingParams.n > 1.
    """

    events: dict[str, RequestEvent]
    finished: list[RequestOutput]


def merge_step_results(results: list[StepResult]) -> StepResult:
    """Consecutive steps' results as one: each sequence's events merged in step order,
    every finished request."""
    merged = StepResult({}, [])
    events = merged.events
    for result in results:
        for key, event in result.events.items():
            events[key] = merge_events(events[key], event) if key in events else event
        merged.finished.extend(result.finished)
    return merged


class StageTimer:
    """Wall-clock seconds of each stage of a step: `mark(x)` ends a stage and returns x."""

    def __init__(self, timer: Callable[[], float]) -> None:
        self._timer = timer
        self._marks = [timer()]

    def mark(self, value: Any) -> Any:
        self._marks.append(self._timer())
        return value

    @property
    def seconds(self) -> tuple[float, ...]:
        return tuple(b - a for a, b in zip(self._marks, self._marks[1:]))

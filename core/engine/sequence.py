"""A request's state as it moves through the engine.

Vocabulary used everywhere: a sequence's *tokens* are its prompt followed by what it
has generated so far. *num_computed_tokens* counts the tokens whose K/V sit in the
cache. A step *schedules* some number of the not-yet-computed tokens; once all tokens
are computed the next forward pass yields logits for a new token.
"""

from __future__ import annotations

import enum

import attrs

from servelab.sampling_params import SamplingParams


def sequence_id(request_id: str, completion_index: int) -> str:
    """The id of completion `completion_index` of a request: the request's own id for the
    first, "{request_id}#{i}" for completion i > 0 of an n > 1 request."""
    return request_id if completion_index == 0 else f"{request_id}#{completion_index}"


def owner_of(sequence_id: str) -> str:
    """The request id a sequence id belongs to (`sequence_id`'s inverse): what precedes a
    final "#<digits>", else the id itself. The engine refuses a request whose id would
    read as another's completion while that one is in flight (RequestTable.check_free)."""
    owner, separator, index = sequence_id.rpartition("#")
    return owner if separator and index.isdecimal() else sequence_id


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@attrs.define(eq=False)
class Sequence:
    """One request (one completion) in flight. The core owns its token bookkeeping;
    schedulers move it between queues and set `num_computed_tokens` back to 0 when
    they preempt it by recompute."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    priority: int = 0
    output_token_ids: list[int] = attrs.field(factory=list)
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    # Computed tokens its recompute preemptions threw away, in total (the kit's scheduler counts them).
    num_discarded_tokens: int = 0
    # Prompt tokens whose K/V a prefix cache held when it was first scheduled (the engine records it).
    num_cached_tokens: int = 0
    # Which of its request's n completions this sequence is (parallel sampling).
    completion_index: int = 0
    # The output text cut just before the stop string that ended it; None otherwise.
    stop_text: str | None = None
    # What ended it with finish_reason "stop": the stop string, or the stop token id
    # (SamplingParams.stop_token_ids); None for EOS or any other reason (vLLM's stop_reason).
    stop_reason: int | str | None = None
    # Speculative decoding: tokens proposed after the last one, to be verified in the next
    # step. They are not tokens of the sequence, but they count as uncomputed tokens, so
    # every scheduler charges them to the token budget and allocates KV slots for them.
    draft_token_ids: list[int] = attrs.field(factory=list)
    num_draft_tokens: int = 0  # drafts verified over the sequence's life
    num_accepted_tokens: int = 0  # of which accepted
    num_sampling_steps: int = 0  # target steps that produced at least one token
    # SamplingParams.logprobs / prompt_logprobs: one {token id: Logprob} per output token,
    # and per prompt token (None for the first, which nothing predicts).
    logprobs: list | None = None
    prompt_logprobs: list | None = None
    error: str | None = None  # why the request failed (finish_reason "error"), e.g. a logits processor raised
    # The LoRA adapter its tokens run with (LoRARequest.lora_int_id, > 0); 0: the base model alone.
    lora_id: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    # The two below spell num_tokens out: they run for every sequence at every step.
    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens (and draft tokens) whose K/V are not in the cache yet."""
        return (len(self.prompt_token_ids) + len(self.output_token_ids) + len(self.draft_token_ids)
                - self.num_computed_tokens)

    @property
    def is_decoding(self) -> bool:
        """Every token but the last is computed: the next step decodes (and verifies drafts)."""
        return self.num_computed_tokens == len(self.prompt_token_ids) + len(self.output_token_ids) - 1

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of prompt + output (+ drafts past the end), without
        concatenating the lists."""
        num_tokens = self.num_tokens
        if stop > num_tokens:
            verified = self.token_slice(start, num_tokens) if start < num_tokens else []
            return verified + self.draft_token_ids[max(start - num_tokens, 0) : stop - num_tokens]
        num_prompt = len(self.prompt_token_ids)
        if stop <= num_prompt:
            return self.prompt_token_ids[start:stop]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : stop - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - num_prompt]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

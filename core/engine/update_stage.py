"""The update stage: what the sampling stage decided becomes the sequences' new state.

In order: every scheduled sequence's computed tokens advance; a sequence a logits
processor failed ends with finish_reason "error"; each sequence's new tokens are
appended up to its first stop (EOS or a stop token, a stop string, max_tokens,
max_model_len); the verify stage settles the verified drafts (rejected slots rolled
back); the prefix cache records the blocks now full of verified tokens; n > 1 children
are forked from their parent; the scheduler retires the finished ones.
"""

from __future__ import annotations

from typing import Any, Callable

import attrs

from servelab.interfaces import PrefixCachingAllocator, Sequence, StepPlan
from servelab.outputs import RequestEvent
from servelab.request import RequestTable
from servelab.sampling_stage import Sampled


@attrs.define
class Updated:
    finished: list[Sequence]  # sequences that finished this step
    events: dict[str, RequestEvent]  # by sequence id: the tokens appended this step (and logprobs)


class UpdateStage:
    def __init__(self, requests: RequestTable, scheduler: Any, allocator: Any, eos_token_ids: frozenset[int],
                 max_model_len: int, settle: Callable[[Sampled], None] | None = None) -> None:
        self.requests = requests
        self.scheduler = scheduler
        self.prefix_cache = allocator if isinstance(allocator, PrefixCachingAllocator) else None
        self.settle = settle  # the verify stage's, under speculative decoding
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def update(self, plan: StepPlan, sampled: Sampled, now: float) -> Updated:
        for seq, num_new in plan.scheduled:
            seq.num_computed_tokens += num_new
        failed = self._fail(sampled, now) if sampled.failures else []
        finished = self._append(sampled, now)
        finished.extend(failed)
        events = {seq.request_id: event for seq, event in sampled.events.items()}
        if not self.requests.all_plain:
            self._add_logprobs(sampled, events)
        if self.settle is not None:
            self.settle(sampled)
        if self.prefix_cache is not None:  # only verified tokens count as computed by now
            for seq, _ in plan.scheduled:
                self.prefix_cache.cache_blocks(seq)
        for parent, children in sampled.forks:  # before `finish`, which may free the parent's KV
            self.scheduler.fork(parent, [child for child in children if child.finish_reason is None])
        self.scheduler.finish(finished)
        return Updated(finished, events)

    def _fail(self, sampled: Sampled, now: float) -> list[Sequence]:
        """Sequences a logits processor failed end with finish_reason "error", without this
        step's token; the rest of the batch goes on."""
        failed = []
        by_id = {seq.request_id: seq for seq in sampled.events}
        for seq_id, error in sampled.failures.items():
            seq = by_id.get(seq_id)
            if seq is None or seq.finish_reason is not None:
                continue
            del sampled.events[seq]
            seq.finish_reason, seq.error, seq.finish_time = "error", error, now
            failed.append(seq)
        return failed

    def _append(self, sampled: Sampled, now: float) -> list[Sequence]:
        """Append each sequence's new tokens up to its first stop (its event cut there)."""
        finished: list[Sequence] = []
        append_token = self._append_token
        for seq, event in sampled.events.items():
            tokens = event.new_token_ids
            if len(tokens) == 1:
                if append_token(seq, tokens[0], now):
                    finished.append(seq)
            else:
                before = seq.num_tokens
                for token_id in tokens:
                    if append_token(seq, token_id, now):
                        finished.append(seq)
                        break
                event.new_token_ids = tuple(seq.output_token_ids[before - seq.num_tokens:])  # always >= 1 token
            seq.num_sampling_steps += 1
        return finished

    def _append_token(self, seq: Sequence, token_id: int, now: float) -> bool:
        """Append a sampled token; True when the sequence has finished."""
        output = seq.output_token_ids
        output.append(token_id)
        if seq.first_token_time is None:
            seq.first_token_time = now
        params = seq.params
        if token_id in self.eos_token_ids and not params.ignore_eos:
            seq.finish_reason = "stop"
        elif token_id in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token_id
        elif params.stop and self._hit_stop_string(seq, token_id):
            seq.finish_reason = "stop"
        elif (len(output) >= params.max_tokens
              or len(seq.prompt_token_ids) + len(output) >= self.max_model_len):  # seq.num_tokens, inlined
            seq.finish_reason = "length"
        else:
            return False
        seq.finish_time = now
        return True

    def _hit_stop_string(self, seq: Sequence, token_id: int) -> bool:
        text = self.requests.of(seq).texts[seq.completion_index]
        added = len(text.append([token_id]))
        if len(seq.output_token_ids) < seq.params.min_tokens or text.find_stop(added) is None:
            return False
        seq.stop_text = text.text_through_stop if seq.params.include_stop_str_in_output else text.stop_text
        seq.stop_reason = text.stop_string
        return True

    @staticmethod
    def _add_logprobs(sampled: Sampled, events: dict[str, RequestEvent]) -> None:
        """The new tokens' logprobs, for the sequences that asked; the prompt's, on completion
        0's event, in the step that scored the whole prompt."""
        for seq, event in sampled.events.items():
            if seq.logprobs is not None:
                end = len(seq.output_token_ids)
                event.new_logprobs = tuple(seq.logprobs[end - len(event.new_token_ids): end])
        for request_id, scored in sampled.scored_prompts.items():
            event = events.get(request_id)
            if event is None:  # its token failed, its prompt logprobs still go out
                event = events[request_id] = RequestEvent()
            event.prompt_logprobs = tuple(scored)

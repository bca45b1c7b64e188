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
from servelab.outputs import PositionLogprobs
from servelab.request import RequestTable
from servelab.sampling_stage import Sampled


@attrs.define
class Updated:
    finished: list[Sequence]  # sequences that finished this step
    emitted: dict[str, list[int]]  # by sequence id: the tokens appended this step
    new_logprobs: dict[str, list[PositionLogprobs]]  # by sequence id, for those that asked


class UpdateStage:
    def __init__(self, requests: RequestTable, scheduler: Any, allocator: Any, eos_token_ids: frozenset[int],
                 max_model_len: int, settle: Callable[[Sampled, dict[str, list[int]]], None] | None = None) -> None:
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
        finished, emitted = self._append(sampled, now)
        finished.extend(failed)
        new_logprobs = {} if self.requests.all_plain else self._new_logprobs(sampled, emitted)
        if self.settle is not None:
            self.settle(sampled, emitted)
        if self.prefix_cache is not None:  # only verified tokens count as computed by now
            for seq, _ in plan.scheduled:
                self.prefix_cache.cache_blocks(seq)
        for parent, children in sampled.forks:  # before `finish`, which may free the parent's KV
            self.scheduler.fork(parent, [child for child in children if child.finish_reason is None])
        self.scheduler.finish(finished)
        return Updated(finished, emitted, new_logprobs)

    def _fail(self, sampled: Sampled, now: float) -> list[Sequence]:
        """Sequences a logits processor failed end with finish_reason "error", without this
        step's token; the rest of the batch goes on."""
        failed = []
        by_id = {seq.request_id: seq for seq in sampled.new_tokens}
        for seq_id, error in sampled.failures.items():
            seq = by_id.get(seq_id)
            if seq is None or seq.finish_reason is not None:
                continue
            del sampled.new_tokens[seq]
            seq.finish_reason, seq.error, seq.finish_time = "error", error, now
            failed.append(seq)
        return failed

    def _append(self, sampled: Sampled, now: float) -> tuple[list[Sequence], dict[str, list[int]]]:
        """Append each sequence's new tokens up to its first stop."""
        finished: list[Sequence] = []
        emitted: dict[str, list[int]] = {}
        append_token = self._append_token
        for seq, tokens in sampled.new_tokens.items():
            if len(tokens) == 1:
                if append_token(seq, tokens[0], now):
                    finished.append(seq)
                emitted[seq.request_id] = tokens  # a list of this step's own
            else:
                before = seq.num_tokens
                for token_id in tokens:
                    if append_token(seq, token_id, now):
                        finished.append(seq)
                        break
                emitted[seq.request_id] = seq.output_token_ids[before - seq.num_tokens:]  # always >= 1 token
            seq.num_sampling_steps += 1
        return finished, emitted

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
    def _new_logprobs(sampled: Sampled, emitted: dict[str, list[int]]) -> dict[str, list[PositionLogprobs]]:
        result = {}
        for seq in sampled.new_tokens:
            if seq.logprobs is not None:
                end = len(seq.output_token_ids)
                result[seq.request_id] = seq.logprobs[end - len(emitted[seq.request_id]): end]
        return result

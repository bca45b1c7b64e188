"""vLLM's three penalties.

- repetition_penalty r (Keskar et al. 2019, as vLLM and transformers): for every token
  in the prompt or the output so far, a positive logit is divided by r, a negative one
  multiplied by r.
- frequency_penalty f: logit -= f * (times the token occurs in the output).
- presence_penalty p: logit -= p for every token that occurs in the output.
"""

from __future__ import annotations

from typing import Any, Sequence as Seq

import attrs
import torch

from servelab.plugins.logits_processors.history import OutputHistory


@attrs.define
class PenaltyState:
    value: float  # the request's penalty
    history: OutputHistory = attrs.field(factory=OutputHistory)
    prompt_tokens: frozenset[int] = frozenset()


class _Penalty:
    field: str
    neutral: float

    def __init__(self, options: Any, context: Any) -> None:
        self.vocab_size = context.vocab_size

    def is_requested(self, params: Any) -> bool:
        return getattr(params, self.field) != self.neutral

    def new_state(self, request: Any) -> PenaltyState:
        return PenaltyState(float(getattr(request.params, self.field)))

    def accept(self, state: PenaltyState, token_id: int) -> None:
        state.history.accept(token_id)

    def rollback(self, state: PenaltyState, num_tokens: int) -> None:
        state.history.rollback(num_tokens)

    def _entries(self, states: Seq[PenaltyState]) -> tuple[list[int], list[int], list[float]]:
        raise NotImplementedError

    def apply(self, logits: torch.Tensor, states: Seq[PenaltyState]) -> torch.Tensor:
        rows, tokens, amounts = self._entries(states)
        if rows:
            self._update(logits, torch.tensor(rows), torch.tensor(tokens),
                         torch.tensor(amounts, dtype=logits.dtype, device=logits.device))
        return logits

    def _update(self, logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor, amounts: torch.Tensor) -> None:
        logits[rows, tokens] -= amounts


class FrequencyPenalty(_Penalty):
    field, neutral = "frequency_penalty", 0.0

    def _entries(self, states):
        rows, tokens, amounts = [], [], []
        for row, state in enumerate(states):
            for token_id, count in state.history.counts.items():
                rows.append(row)
                tokens.append(token_id)
                amounts.append(state.value * count)
        return rows, tokens, amounts


class PresencePenalty(_Penalty):
    field, neutral = "presence_penalty", 0.0

    def _entries(self, states):
        rows, tokens, amounts = [], [], []
        for row, state in enumerate(states):
            for token_id in state.history.counts:
                rows.append(row)
                tokens.append(token_id)
                amounts.append(state.value)
        return rows, tokens, amounts


class RepetitionPenalty(_Penalty):
    field, neutral = "repetition_penalty", 1.0

    def new_state(self, request: Any) -> PenaltyState:
        return PenaltyState(float(request.params.repetition_penalty),
                            prompt_tokens=frozenset(request.prompt_token_ids))

    def _entries(self, states):
        rows, tokens, amounts = [], [], []
        for row, state in enumerate(states):
            seen = state.prompt_tokens.union(state.history.counts)
            rows.extend([row] * len(seen))
            tokens.extend(seen)
            amounts.extend([state.value] * len(seen))
        return rows, tokens, amounts

    def _update(self, logits, rows, tokens, amounts):
        values = logits[rows, tokens]
        logits[rows, tokens] = torch.where(values > 0, values / amounts, values * amounts)

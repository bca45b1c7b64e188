"""vLLM's three penalties.

- repetition_penalty r (Keskar et al. 2019, as vLLM and transformers): for every token
  in the prompt or the output so far, a positive logit is divided by r, a negative one
  multiplied by r.
- frequency_penalty f: logit -= f * (times the token occurs in the output).
- presence_penalty p: logit -= p for every token that occurs in the output.

Each request's state is a TokenTally (its distinct tokens and their counts as tensors,
updated token by token), so a step costs the new tokens in Python and one batched
indexing operation over every row's distinct tokens in torch.
"""

from __future__ import annotations

from typing import Any, Sequence as Seq

import attrs
import torch

from servelab.plugins.logits_processors.tally import TokenTally


@attrs.define
class PenaltyState:
    value: float  # the request's penalty
    tally: TokenTally = attrs.field(factory=TokenTally)  # output tokens (repetition: and the prompt's)


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
        state.tally.accept(token_id)

    def rollback(self, state: PenaltyState, num_tokens: int) -> None:
        state.tally.rollback(num_tokens)

    def apply(self, logits: torch.Tensor, states: Seq[PenaltyState]) -> torch.Tensor:
        sizes = [state.tally.size for state in states]
        if not any(sizes):
            return logits
        logits = logits.contiguous()
        device = logits.device
        ids = torch.cat([state.tally.ids for state in states]).to(device)
        counts = torch.cat([state.tally.counts for state in states]).to(device=device, dtype=logits.dtype)
        sizes_tensor = torch.tensor(sizes, device=device)
        rows = torch.repeat_interleave(torch.arange(len(states), device=device), sizes_tensor)
        values = torch.repeat_interleave(torch.tensor([state.value for state in states], dtype=logits.dtype,
                                                      device=device), sizes_tensor)
        self._update(logits.view(-1), rows * logits.shape[1] + ids, counts, values)
        return logits

    def _update(self, flat: torch.Tensor, positions: torch.Tensor, counts: torch.Tensor,
                values: torch.Tensor) -> None:
        """Penalise `flat[positions]` (each row's distinct tokens: no position twice)."""
        raise NotImplementedError


class FrequencyPenalty(_Penalty):
    field, neutral = "frequency_penalty", 0.0

    def _update(self, flat, positions, counts, values):
        flat[positions] -= values * counts


class PresencePenalty(_Penalty):
    field, neutral = "presence_penalty", 0.0

    def _update(self, flat, positions, counts, values):
        flat[positions] -= values  # every token in the tally occurs at least once


class RepetitionPenalty(_Penalty):
    field, neutral = "repetition_penalty", 1.0

    def new_state(self, request: Any) -> PenaltyState:
        return PenaltyState(float(request.params.repetition_penalty), TokenTally(request.prompt_token_ids))

    def _update(self, flat, positions, counts, values):
        seen = flat[positions]
        flat[positions] = torch.where(seen > 0, seen / values, seen * values)

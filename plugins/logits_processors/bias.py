"""logit_bias: {token id: bias} added to the logits (OpenAI's and vLLM's meaning)."""

from __future__ import annotations

from typing import Any, Sequence as Seq

import torch

from servelab.errors import RequestError


class LogitBias:
    def __init__(self, options: Any, context: Any) -> None:
        self.vocab_size = context.vocab_size

    def is_requested(self, params: Any) -> bool:
        return bool(params.logit_bias)

    def validate(self, params: Any) -> None:
        for token_id, _ in params.logit_bias:
            if token_id >= self.vocab_size:
                raise RequestError(f"logit_bias token id {token_id} is outside the vocabulary [0, {self.vocab_size})")

    def new_state(self, request: Any) -> tuple[tuple[int, float], ...]:
        return request.params.logit_bias  # nothing changes as tokens are accepted

    def apply(self, logits: torch.Tensor, states: Seq[Any]) -> torch.Tensor:
        rows = [row for row, bias in enumerate(states) for _ in bias]
        tokens = [token_id for bias in states for token_id, _ in bias]
        amounts = [amount for bias in states for _, amount in bias]
        logits[torch.tensor(rows), torch.tensor(tokens)] += torch.tensor(amounts, dtype=logits.dtype)
        return logits

    def accept(self, state: Any, token_id: int) -> None:
        pass

    def rollback(self, state: Any, num_tokens: int) -> None:
        pass

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

    def new_state(self, request: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The bias as two tensors (token ids, amounts), built once per request: a step
        concatenates them, whatever their size, instead of rebuilding Python lists."""
        bias = request.params.logit_bias
        return (torch.tensor([token_id for token_id, _ in bias], dtype=torch.int64),
                torch.tensor([amount for _, amount in bias], dtype=torch.float32))

    def apply(self, logits: torch.Tensor, states: Seq[Any]) -> torch.Tensor:
        counts = torch.tensor([len(tokens) for tokens, _ in states], dtype=torch.int64)
        rows = torch.repeat_interleave(torch.arange(len(states)), counts).to(logits.device)
        tokens = torch.cat([tokens for tokens, _ in states]).to(logits.device)
        amounts = torch.cat([amounts for _, amounts in states]).to(device=logits.device, dtype=logits.dtype)
        logits.index_put_((rows, tokens), amounts, accumulate=True)
        return logits

    def accept(self, state: Any, token_id: int) -> None:
        pass

    def rollback(self, state: Any, num_tokens: int) -> None:
        pass

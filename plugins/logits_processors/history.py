"""Per-request token history with exact rollback, shared by the built-in processors."""

from __future__ import annotations

from collections import Counter

import attrs


@attrs.define
class OutputHistory:
    """The request's output tokens so far, and how often each occurs."""

    tokens: list[int] = attrs.field(factory=list)
    counts: Counter = attrs.field(factory=Counter)

    def accept(self, token_id: int) -> None:
        self.tokens.append(token_id)
        self.counts[token_id] += 1

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > len(self.tokens):
            raise ValueError(f"cannot roll back {num_tokens} tokens: only {len(self.tokens)} were accepted")
        for _ in range(num_tokens):
            token_id = self.tokens.pop()
            self.counts[token_id] -= 1
            if not self.counts[token_id]:
                del self.counts[token_id]

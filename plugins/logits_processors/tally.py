"""A request's distinct tokens and their counts as tensors, kept up to date token by token.

The penalties touch every distinct token a request has seen, every step: the tally keeps
those tokens (`ids`) and their counts (`counts`) in tensors grown in place, so a step
costs the request's new tokens in Python (an accepted token is one slot updated, a
rolled-back one one slot decremented or removed) and its distinct tokens only in torch's
vectorised indexing, never a Python list rebuilt from the whole history.
"""

from __future__ import annotations

from typing import Iterable

import torch

_INITIAL_CAPACITY = 16


class TokenTally:
    """Distinct tokens with a count above zero: `ids[:size]`, `counts[:size]` (float32, so
    they scale logits directly). Tokens accepted after the base can be rolled back exactly."""

    def __init__(self, base: Iterable[int] = ()) -> None:
        base_ids, base_counts = _unique(base)
        capacity = max(_INITIAL_CAPACITY, 2 * len(base_ids))
        self._ids = torch.zeros(capacity, dtype=torch.int64)
        self._counts = torch.zeros(capacity, dtype=torch.float32)
        self._ids[:len(base_ids)] = base_ids
        self._counts[:len(base_ids)] = base_counts
        self._by_slot: list[int] = base_ids.tolist()  # the token in each slot
        self._slot = {token: slot for slot, token in enumerate(self._by_slot)}
        self._count = dict(zip(self._by_slot, base_counts.to(torch.int64).tolist()))
        self._accepted: list[int] = []  # tokens accepted after the base, in order (for rollback)

    @property
    def size(self) -> int:
        return len(self._by_slot)

    @property
    def ids(self) -> torch.Tensor:
        return self._ids[:self.size]

    @property
    def counts(self) -> torch.Tensor:
        return self._counts[:self.size]

    def accept(self, token_id: int) -> None:
        count = self._count.get(token_id, 0) + 1
        self._count[token_id] = count
        if count == 1:
            slot = self.size
            if slot == len(self._ids):
                self._grow()
            self._slot[token_id] = slot
            self._by_slot.append(token_id)
            self._ids[slot] = token_id
        self._counts[self._slot[token_id]] = count
        self._accepted.append(token_id)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > len(self._accepted):
            raise ValueError(f"cannot roll back {num_tokens} tokens: only {len(self._accepted)} were accepted")
        for _ in range(num_tokens):
            token_id = self._accepted.pop()
            count = self._count[token_id] - 1
            slot = self._slot[token_id]
            if count:
                self._count[token_id] = count
                self._counts[slot] = count
                continue
            # its last occurrence: the token in the last slot moves into its place
            del self._count[token_id], self._slot[token_id]
            moved = self._by_slot.pop()
            if moved != token_id:
                self._by_slot[slot] = moved
                self._slot[moved] = slot
                self._ids[slot] = moved
                self._counts[slot] = self._count[moved]

    def _grow(self) -> None:
        capacity = 2 * len(self._ids)
        ids, counts = torch.zeros(capacity, dtype=torch.int64), torch.zeros(capacity, dtype=torch.float32)
        ids[:len(self._ids)] = self._ids
        counts[:len(self._counts)] = self._counts
        self._ids, self._counts = ids, counts


def _unique(tokens: Iterable[int]) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.as_tensor(list(tokens), dtype=torch.int64)
    if not len(tokens):
        return tokens, torch.zeros(0, dtype=torch.float32)
    ids, counts = torch.unique(tokens, return_counts=True)
    return ids, counts.to(torch.float32)

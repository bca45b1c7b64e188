"""Processors that ban tokens outright (their logits become -inf).

- min_tokens (vLLM): until the output has min_tokens tokens, EOS and the request's
  stop_token_ids cannot be sampled.
- bad_words (vLLM): each bad word is tokenized as written and with a leading space; a
  token that would complete one of those token sequences right after the output so far
  is banned.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future
from typing import Any, Sequence as Seq

import attrs
import torch

from servelab.errors import RequestError
from servelab.plugins.logits_processors.history import OutputHistory


def _ban(logits: torch.Tensor, rows: list[int], tokens: list[int]) -> torch.Tensor:
    if rows:
        logits[torch.tensor(rows), torch.tensor(tokens)] = float("-inf")
    return logits


@attrs.define
class MinTokensState:
    min_tokens: int
    banned: tuple[int, ...]
    num_output: int = 0


class MinTokens:
    def __init__(self, options: Any, context: Any) -> None:
        self.eos_token_ids = tuple(sorted(context.eos_token_ids))
        self.vocab_size = context.vocab_size

    def is_requested(self, params: Any) -> bool:
        return params.min_tokens > 0

    def new_state(self, request: Any) -> MinTokensState:
        params = request.params
        banned = {*self.eos_token_ids, *params.stop_token_ids}
        return MinTokensState(params.min_tokens, tuple(sorted(t for t in banned if t < self.vocab_size)))

    def apply(self, logits: torch.Tensor, states: Seq[MinTokensState]) -> torch.Tensor:
        rows, tokens = [], []
        for row, state in enumerate(states):
            if state.num_output < state.min_tokens:
                rows.extend([row] * len(state.banned))
                tokens.extend(state.banned)
        return _ban(logits, rows, tokens)

    def accept(self, state: MinTokensState, token_id: int) -> None:
        state.num_output += 1

    def rollback(self, state: MinTokensState, num_tokens: int) -> None:
        if num_tokens > state.num_output:
            raise ValueError(f"cannot roll back {num_tokens} tokens: only {state.num_output} were accepted")
        state.num_output -= num_tokens


@attrs.define
class BadWordsState:
    sequences: tuple[tuple[int, ...], ...]
    history: OutputHistory = attrs.field(factory=OutputHistory)


class BadWords:
    CACHE_SIZE = 64  # bad-word lists whose tokenization is kept

    def __init__(self, options: Any, context: Any) -> None:
        self.tokenizer = context.tokenizer
        self.vocab_size = context.vocab_size
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, ...], tuple[tuple[int, ...], ...]] = OrderedDict()

    def is_requested(self, params: Any) -> bool:
        return bool(params.bad_words)

    def validate(self, params: Any) -> None:
        if self.tokenizer is None:
            raise RequestError("bad_words need a tokenizer; this checkpoint has none")

    def prepare(self, params: Any) -> Future:
        """The bad words' token sequences, tokenized once per request (one batch call, which
        runs without the GIL) wherever admission prepares it, not on the step loop: a request's
        sequences share them, and a repeated list is found in a small cache."""
        future: Future = Future()
        key = params.bad_words
        with self._lock:
            sequences = self._cache.get(key)
            if sequences is not None:
                self._cache.move_to_end(key)
        if sequences is None:
            texts = [text for word in key for text in (word, " " + word.lstrip())]
            encoded = self.tokenizer.encode_batch(texts, add_special_tokens=False)
            sequences = tuple(sorted({tuple(ids) for ids in encoded if ids and max(ids) < self.vocab_size}))
            with self._lock:
                self._cache[key] = sequences
                while len(self._cache) > self.CACHE_SIZE:
                    self._cache.popitem(last=False)
        future.set_result(sequences)
        return future

    def new_state(self, request: Any) -> BadWordsState:
        sequences = request.prepared
        if sequences is None:  # a caller that did not prepare
            sequences = self.prepare(request.params).result()
        return BadWordsState(sequences)

    def apply(self, logits: torch.Tensor, states: Seq[BadWordsState]) -> torch.Tensor:
        rows, tokens = [], []
        for row, state in enumerate(states):
            output = state.history.tokens
            for sequence in state.sequences:
                prefix = sequence[:-1]
                if len(prefix) <= len(output) and (not prefix or tuple(output[len(output) - len(prefix):]) == prefix):
                    rows.append(row)
                    tokens.append(sequence[-1])
        return _ban(logits, rows, tokens)

    def accept(self, state: BadWordsState, token_id: int) -> None:
        state.history.accept(token_id)

    def rollback(self, state: BadWordsState, num_tokens: int) -> None:
        state.history.rollback(num_tokens)

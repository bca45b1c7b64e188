"""The logits-processor contract (kind `logits_processors`, `[logits_processors]`): the
factory context, the request record a state is created from, the Protocol and its
optional capabilities. Changes by version: docs/contract-versions.md ("logits_processors").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, Sequence as Seq, runtime_checkable

import attrs

if TYPE_CHECKING:  # torch stays out of imports that plugin discovery triggers
    import torch

__all__ = [
    "LogitsProcessorContext",
    "ProcessorRequest",
    "LogitsProcessor",
    "ValidatingProcessor",
    "PreparingProcessor",
    "SelfSelectingProcessor",
    "ReleasingProcessor",
    "WarmingProcessor",
    "ClosingProcessor",
]


@attrs.frozen
class LogitsProcessorContext:
    """What a logits processor factory receives."""

    vocab_size: int  # logits columns (the model's vocabulary, which may exceed the tokenizer's)
    eos_token_ids: frozenset[int]
    # encode(text, add_special_tokens) / decode(ids); `.backend` is the `tokenizers.Tokenizer`.
    tokenizer: Any = None  # None when the checkpoint has none
    device: Any = None  # torch.device of the logits


@attrs.frozen
class ProcessorRequest:
    """A request (one completion) as a processor sees it when its state is created."""

    request_id: str  # the sequence id (completion i > 0 of an n > 1 request is "{id}#{i}")
    params: Any  # SamplingParams
    prompt_token_ids: tuple[int, ...]
    prepared: Any = None  # what `prepare(params)` produced, for processors that define it


@runtime_checkable
class LogitsProcessor(Protocol):
    """Changes next-token logits before sampling: penalties, biases, bans, grammars.

    One instance serves every request; what it knows about one request lives in a
    per-request *state* it creates and the engine hands back:

    - `new_state` at admission (every completion of an n > 1 request gets its own);
    - `apply` once per engine step over the rows that sample, row i with `states[i]`;
      a row's result must not depend on the other rows;
    - `accept` with each token appended to the request, in order;
    - `rollback(state, k)` forgets the last k accepted tokens exactly (speculative
      decoding accepts drafts tentatively to score the positions after them);
    - `release` once the request finished, was aborted or failed (optional).

    A request uses the processor when it names it in `SamplingParams.logits_processors`,
    when the engine config lists it under `[logits_processors] default`, or when
    `is_requested(params)` says its SamplingParams ask for it (how the built-ins are
    selected; optional, like the two below). `validate(params)` raises RequestError for a request
    it cannot serve (checked before the request is queued); `prepare(params)` returns a
    concurrent.futures.Future whose result becomes ProcessorRequest.prepared: the
    request waits for it, other requests keep running (the grammar compiler uses it).
    A processor that raises fails the requests whose rows it was processing, alone.
    """

    def new_state(self, request: ProcessorRequest) -> Any:
        """The state of a newly admitted request."""

    def apply(self, logits: "torch.Tensor", states: Seq[Any]) -> "torch.Tensor":
        """Processed logits [R, vocab] float32 for rows [R, vocab] (may modify `logits` in place)."""

    def accept(self, state: Any, token_id: int) -> None:
        """`token_id` was appended to the request."""

    def rollback(self, state: Any, num_tokens: int) -> None:
        """Forget the last `num_tokens` accepted tokens."""


@runtime_checkable
class ValidatingProcessor(Protocol):
    """A logits processor that refuses some requests before they are queued."""

    def validate(self, params: Any) -> None:
        """Raise RequestError naming what this processor cannot serve."""


@runtime_checkable
class PreparingProcessor(Protocol):
    """A logits processor that prepares something per request off the step loop."""

    def prepare(self, params: Any) -> Any:
        """A concurrent.futures.Future whose result becomes ProcessorRequest.prepared, or None."""


@runtime_checkable
class SelfSelectingProcessor(Protocol):
    """A logits processor that SamplingParams fields select (the built-ins)."""

    def is_requested(self, params: Any) -> bool:
        """True when `params` ask for this processor."""


@runtime_checkable
class ReleasingProcessor(Protocol):
    """A logits processor whose states hold something to let go of."""

    def release(self, state: Any) -> None:
        """The request finished, was aborted or failed."""


@runtime_checkable
class WarmingProcessor(Protocol):
    """A logits processor with slow one-time set-up (an import, a first compilation) that a
    server runs on a thread of its own at start, before the first request needs it."""

    def warm_up(self) -> None: ...


@runtime_checkable
class ClosingProcessor(Protocol):
    """A logits processor holding something that outlives a request (a compiler process)."""

    def close(self) -> None:
        """The engine is stopping: end it now, without waiting for work in progress."""

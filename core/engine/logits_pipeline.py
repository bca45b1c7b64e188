"""The engine's side of logits processors: which requests use which processor, their
per-request states, and the batched calls, with each request's failures kept its own.

The states live on the request (servelab.request.Request.processor_states) and are
passed in with every call. A request's processors are the ones it selects (see interfaces.LogitsProcessor); they
run in catalogue order, except that `structured` (the grammar mask) runs last, so the
tokens it allows are the only ones left whatever the others did.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Callable, Sequence as Seq

import torch

from servelab.errors import ConfigError, RequestError
from servelab.interfaces import (PreparingProcessor, ProcessorRequest, ReleasingProcessor, SelfSelectingProcessor,
                                 Sequence, ValidatingProcessor)
from servelab.logging_setup import get_logger

logger = get_logger(__name__)
LAST = ("structured",)


class ProcessorFailed(Exception):
    """A processor raised for one request."""


class LogitsPipeline:
    def __init__(self, processors: dict[str, Any], defaults: Seq[str]) -> None:
        unknown = [name for name in defaults if name not in processors]
        if unknown:
            raise ConfigError(f"[logits_processors] default names unknown processor {unknown[0]!r}; "
                              f"installed: {', '.join(processors) or 'none'}")
        order = [n for n in processors if n not in LAST] + [n for n in LAST if n in processors]
        self.processors = {name: processors[name] for name in order}
        self.defaults = tuple(defaults)

    # ------------------------------------------------------------ admission

    def selected(self, params: Any) -> list[str]:
        """The processors a request uses, in application order (RequestError for an unknown name)."""
        for name in params.logits_processors:
            if name not in self.processors:
                raise RequestError(f"logits_processors names unknown processor {name!r}; "
                                   f"installed: {', '.join(self.processors) or 'none'}")
        named = set(params.logits_processors) | set(self.defaults)
        return [name for name, processor in self.processors.items()
                if name in named or _is_requested(processor, params)]

    def validate(self, params: Any) -> None:
        for name in self.selected(params):
            processor = self.processors[name]
            if isinstance(processor, ValidatingProcessor):
                processor.validate(params)

    def prepare(self, params: Any) -> dict[str, Future]:
        """Futures of the processors that prepare something per request (grammar compilation)."""
        futures = {}
        for name in self.selected(params):
            processor = self.processors[name]
            if isinstance(processor, PreparingProcessor):
                future = processor.prepare(params)
                if future is not None:
                    futures[name] = future
        return futures

    def new_states(self, seq: Sequence, prepared: dict[str, Any]) -> dict[str, Any]:
        """`seq`'s processor states, by processor name (raises ProcessorFailed naming the processor)."""
        states = {}
        for name in self.selected(seq.params):
            request = ProcessorRequest(seq.request_id, seq.params, tuple(seq.prompt_token_ids), prepared.get(name))
            states[name] = self._call(name, lambda p: p.new_state(request), "new_state")
        return states

    def release(self, seq_id: str, states: dict[str, Any]) -> None:
        for name, state in states.items():
            processor = self.processors[name]
            if isinstance(processor, ReleasingProcessor):
                try:
                    processor.release(state)
                except Exception as exc:  # the request is over; its failure to clean up is logged only
                    logger.warning("logits_processor.release_failed", processor=name, request_id=seq_id,
                                   error=f"{type(exc).__name__}: {exc}")

    # ------------------------------------------------------------ per step
    # Row i of a call belongs to seqs[i], whose processor states are states[i].

    def apply(self, logits: torch.Tensor, seqs: Seq[Sequence], states: Seq[dict[str, Any]],
              rows: Seq[int] | None = None, failed: dict[str, str] | None = None) -> dict[str, str]:
        """Process logits rows in place: row rows[i] (default i) belongs to seqs[i].
        Returns {sequence id: error} of the requests a processor failed (added to `failed`)."""
        failed = {} if failed is None else failed
        rows = list(range(len(seqs))) if rows is None else list(rows)
        with torch.inference_mode():  # the model's logits are inference tensors
            self._apply(logits, seqs, states, rows, failed)
        return failed

    def _apply(self, logits: torch.Tensor, seqs: Seq[Sequence], states: Seq[dict[str, Any]], rows: list[int],
               failed: dict[str, str]) -> None:
        for name, processor in self.processors.items():
            members = [(row, held[name], s.request_id) for row, s, held in zip(rows, seqs, states)
                       if s.request_id not in failed and name in held]
            if not members:
                continue
            index = torch.tensor([m[0] for m in members], dtype=torch.int64, device=logits.device)
            try:
                logits[index] = processor.apply(logits[index], [m[1] for m in members])
            except Exception:
                # Find whose row it was: one call per row, each failure its own request's.
                for row, state, seq_id in members:
                    try:
                        logits[row: row + 1] = processor.apply(logits[row: row + 1], [state])
                    except Exception as exc:
                        failed[seq_id] = _describe(name, "apply", exc)

    def accept(self, seq: Sequence, states: dict[str, Any], token_ids: Seq[int], failed: dict[str, str]) -> None:
        if not states or seq.request_id in failed:
            return
        for name, state in states.items():
            processor = self.processors[name]
            try:
                for token_id in token_ids:
                    processor.accept(state, token_id)
            except Exception as exc:
                failed[seq.request_id] = _describe(name, "accept", exc)
                return

    def rollback(self, seq: Sequence, states: dict[str, Any], num_tokens: int, failed: dict[str, str]) -> None:
        if not states or num_tokens <= 0 or seq.request_id in failed:
            return
        for name, state in states.items():
            try:
                self.processors[name].rollback(state, num_tokens)
            except Exception as exc:
                failed[seq.request_id] = _describe(name, "rollback", exc)
                return

    def apply_speculative(self, logits: torch.Tensor, seqs: Seq[Sequence], states: Seq[dict[str, Any]],
                          first_rows: Seq[int], num_rows: Seq[int], failed: dict[str, str]) -> None:
        """Process each sequence's draft rows in place: row j of a sequence is processed with
        its state after its first j drafts, accepted tentatively here. The caller rolls the
        drafts back once verification has decided (`settle_speculative`)."""
        users = [i for i, held in enumerate(states) if held]
        for depth in range(max((num_rows[i] for i in users), default=0)):
            at_depth = [i for i in users if depth < num_rows[i]]
            self.apply(logits, [seqs[i] for i in at_depth], [states[i] for i in at_depth],
                       [first_rows[i] + depth for i in at_depth], failed)
            for i in at_depth:
                if depth < num_rows[i] - 1:
                    self.accept(seqs[i], states[i], [seqs[i].draft_token_ids[depth]], failed)

    def settle_speculative(self, seq: Sequence, states: dict[str, Any], num_drafts: int, num_accepted: int,
                           token_ids: Seq[int], failed: dict[str, str]) -> None:
        """Keep the accepted drafts, forget the rejected ones, then accept the target's token."""
        self.rollback(seq, states, num_drafts - num_accepted, failed)
        self.accept(seq, states, token_ids[num_accepted:], failed)

    def _call(self, name: str, call: Callable[[Any], Any], method: str) -> Any:
        try:
            return call(self.processors[name])
        except RequestError:
            raise
        except Exception as exc:
            raise ProcessorFailed(_describe(name, method, exc)) from exc


def _is_requested(processor: Any, params: Any) -> bool:
    return isinstance(processor, SelfSelectingProcessor) and bool(processor.is_requested(params))


def _describe(name: str, method: str, exc: Exception) -> str:
    logger.warning("logits_processor.failed", processor=name, method=method, error=f"{type(exc).__name__}: {exc}")
    return f"logits processor {name!r} failed in {method}: {type(exc).__name__}: {exc}"

"""Structured output through xgrammar: JSON schema, any JSON object, regex, EBNF.

A request's grammar is compiled against the tokenizer on a worker thread (`prepare`):
the request waits for it, other requests keep stepping. Compiled grammars are cached
per (kind, spec), and concurrent requests with one schema share one compilation. Each
request's state is an xgrammar GrammarMatcher; every step its next-token bitmask is
applied to its logits row (a batched bitmask for all structured rows of the step).

Speculative decoding accepts drafts tentatively: a draft the grammar forbids was masked
out of the row that verifies it (so verification rejects it), and the rows after it are
never used. The state counts such tokens as "dead" so rollback stays exact.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Sequence as Seq

import attrs
import torch

from servelab.errors import RequestError

CACHE_SIZE = 256  # compiled grammars kept


def _xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise RequestError("structured output needs xgrammar: pip install 'servelab[structured]'") from None
    return xgrammar


@attrs.define
class GrammarState:
    matcher: Any  # xgrammar.GrammarMatcher
    dead: int = 0  # tokens accepted after one the grammar refused (a rejected draft and those after it)


class StructuredOutputProcessor:
    def __init__(self, options: Any, context: Any) -> None:
        self.vocab_size = context.vocab_size
        self.tokenizer = context.tokenizer
        self.eos_token_ids = sorted(context.eos_token_ids)
        self._compiler = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._executor: ThreadPoolExecutor | None = None
        self._bitmask: torch.Tensor | None = None

    def is_requested(self, params: Any) -> bool:
        return params.structured is not None

    # ------------------------------------------------------------ admission

    def validate(self, params: Any) -> None:
        """Refuse what cannot work before the request is queued: no tokenizer, no xgrammar,
        ignore_eos (the grammar ends the output with EOS), or a spec xgrammar cannot parse."""
        if self.tokenizer is None:
            raise RequestError("structured output needs a tokenizer; this checkpoint has none")
        if params.ignore_eos:
            raise RequestError("structured output ends the output with EOS; it cannot be combined with ignore_eos")
        xgr = _xgrammar()
        structured = params.structured
        with self._lock:
            if (structured.kind, structured.spec) in self._cache:
                return
        try:
            if structured.kind == "json":
                xgr.Grammar.from_json_schema(structured.spec, any_whitespace=False)
            elif structured.kind == "regex":
                xgr.Grammar.from_regex(structured.spec)
            elif structured.kind == "grammar":
                xgr.Grammar.from_ebnf(structured.spec)
        except Exception as exc:
            what = {"json": "JSON schema", "regex": "regex", "grammar": "grammar"}[structured.kind]
            raise RequestError(f"structured output {what} is invalid: {_first_line(exc)}") from None

    def prepare(self, params: Any) -> Future:
        """The compiled grammar (a Future: compilation runs on a worker thread)."""
        structured = params.structured
        key = (structured.kind, structured.spec)
        with self._lock:
            future = self._cache.get(key)
            if future is not None and not (future.done() and future.exception() is not None):
                self._cache.move_to_end(key)
                return future
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="servelab-grammar")
            future = self._executor.submit(self._compile, structured.kind, structured.spec)
            self._cache[key] = future
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
            return future

    def _compile(self, kind: str, spec: str) -> Any:
        compiler = self._grammar_compiler()
        if kind == "json":
            return compiler.compile_json_schema(spec, any_whitespace=False)
        if kind == "json_object":
            return compiler.compile_json_schema(json.dumps({"type": "object"}), any_whitespace=False)
        if kind == "regex":
            return compiler.compile_regex(spec)
        return compiler.compile_grammar(spec)

    def _grammar_compiler(self) -> Any:
        if self._compiler is None:
            xgr = _xgrammar()
            backend = self.tokenizer.backend
            vocab = backend.get_vocab(with_added_tokens=True)
            encoded = [""] * self.vocab_size
            for token, token_id in vocab.items():
                if token_id < self.vocab_size:
                    encoded[token_id] = token
            metadata = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
            info = xgr.TokenizerInfo(encoded, metadata["vocab_type"], vocab_size=self.vocab_size,
                                     stop_token_ids=self.eos_token_ids or None,
                                     add_prefix_space=metadata["add_prefix_space"])
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)
        return self._compiler

    def new_state(self, request: Any) -> GrammarState:
        return GrammarState(_xgrammar().GrammarMatcher(request.prepared))

    def release(self, state: GrammarState) -> None:
        state.matcher = None

    # ------------------------------------------------------------ per step

    def apply(self, logits: torch.Tensor, states: Seq[GrammarState]) -> torch.Tensor:
        with torch.inference_mode():  # the bitmask buffer may have been made inside inference mode
            return self._apply(logits, states)

    def _apply(self, logits: torch.Tensor, states: Seq[GrammarState]) -> torch.Tensor:
        xgr = _xgrammar()
        rows = len(states)
        if self._bitmask is None or self._bitmask.shape[0] < rows:
            self._bitmask = xgr.allocate_token_bitmask(max(rows, 64), self.vocab_size)
        bitmask = self._bitmask[:rows]
        bitmask.fill_(-1)  # all allowed: rows no token of the request can follow stay unmasked
        for row, state in enumerate(states):
            # After a refused token or EOS (a tentatively accepted draft) the row is never used.
            if not state.dead and not state.matcher.is_terminated():
                state.matcher.fill_next_token_bitmask(bitmask, row)
        logits = logits.contiguous()
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size)
        return logits

    def accept(self, state: GrammarState, token_id: int) -> None:
        if state.dead:
            state.dead += 1
        elif not state.matcher.accept_token(token_id):
            state.dead = 1

    def rollback(self, state: GrammarState, num_tokens: int) -> None:
        dead = min(state.dead, num_tokens)
        state.dead -= dead
        if num_tokens > dead:
            state.matcher.rollback(num_tokens - dead)


def _first_line(exc: Exception) -> str:
    """xgrammar's message without its C++ source location ("[12:00:00] /path/file.cc:42: ")."""
    text = str(exc).strip().splitlines()
    return re.sub(r"^\[[0-9:]+\] \S+:[0-9]+: ", "", text[0]) if text else type(exc).__name__

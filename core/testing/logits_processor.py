"""LogitsProcessorContract: what every logits processor must do.

    from servelab import SamplingParams
    from servelab.testing import LogitsProcessorContract

    class TestMine(LogitsProcessorContract):
        factory = MyProcessor                          # or: plugin_name = "mine"
        requests = [SamplingParams(extra_args={"strength": 2.0})]   # params that use it

The processor is exercised the way the engine drives it: states created per request,
one batched `apply` per step, tokens accepted one by one, drafts accepted tentatively
and rolled back. Histories follow the processor's own output (the argmax of processed
random logits), so grammar-like processors are exercised along tokens they allow, with
random tokens mixed in. The context is builtin:tiny's (its tokenizer and vocabulary)
unless `context()` is overridden.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from servelab.interfaces import (LogitsProcessor, LogitsProcessorContext, PreparingProcessor, ProcessorRequest,
                                 SelfSelectingProcessor)
from servelab.sampling_params import SamplingParams
from servelab.testing.contract import PolicyContract, check, exercising

IMPLEMENTS = "implements LogitsProcessor (new_state, apply, accept, rollback)"
NOT_REQUESTED = "no effect when not requested: default SamplingParams do not select it"
REQUESTED = "the contract's requests select it"
SHAPE = "apply returns float logits of the shape it was given"
BATCH_INDEPENDENT = "batch-independent: a row's result does not depend on its neighbours"
ROLLBACK = "rollback restores state exactly: after accepting k tokens and rolling k back, apply gives what it gave before"
DETERMINISTIC = "two states of one request, fed the same tokens, process logits identically"


class LogitsProcessorContract(PolicyContract):
    """Invariants (each failure message starts "invariant violated: <name>"):

    - implements LogitsProcessor
    - no effect when not requested: `is_requested(SamplingParams())` is False (the engine
      then never passes such a request's rows to it)
    - the contract's `requests` select it (through is_requested or by name)
    - apply returns float logits of the shape it was given
    - batch-independent: each row processed in a batch equals that row processed alone
    - rollback restores state exactly (after k accepted tokens, including tokens the
      processor forbids, as rejected drafts may be)
    - deterministic: two states of one request behave identically
    """

    kind = "logits_processors"
    requests: list[SamplingParams] = []  # SamplingParams that use the processor (at least one)
    prompt: tuple[int, ...] = (5, 17, 42, 5, 99)
    max_examples = 15
    steps = 6  # tokens per generated history

    def context(self) -> LogitsProcessorContext:
        """builtin:tiny's vocabulary and tokenizer."""
        from servelab.model.builtin import resolve
        from servelab.model.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_directory(resolve("builtin:tiny"))
        return LogitsProcessorContext(vocab_size=tokenizer.vocab_size, eos_token_ids=frozenset({2}),
                                      tokenizer=tokenizer, device="cpu")

    @pytest.fixture
    def processor(self) -> Any:
        self._context = self.context()
        return self.make(self._context)

    def _requests(self) -> list[SamplingParams]:
        check(self.requests, REQUESTED, f"{type(self).__name__}.requests lists no SamplingParams that use it")
        return list(self.requests)

    def new_state(self, processor: Any, params: SamplingParams, request_id: str = "req") -> Any:
        """A state created as the engine creates it (after `prepare`, where defined)."""
        prepared = None
        if isinstance(processor, PreparingProcessor):
            future = processor.prepare(params)
            prepared = future.result(timeout=120) if future is not None else None
        return processor.new_state(ProcessorRequest(request_id, params, tuple(self.prompt), prepared))

    def _logits(self, rng: random.Random, rows: int):
        import torch

        generator = torch.Generator().manual_seed(rng.randrange(2**31))
        return torch.randn(rows, self._context.vocab_size, generator=generator) * 3

    def _apply(self, processor: Any, logits, states: list[Any]):
        with exercising(SHAPE):
            out = processor.apply(logits.clone(), states)
        check(tuple(out.shape) == tuple(logits.shape) and out.dtype.is_floating_point, SHAPE,
              lambda: f"got {tuple(out.shape)} {out.dtype} for {tuple(logits.shape)}")
        return out

    def _advance(self, processor: Any, state: Any, rng: random.Random, count: int) -> list[int]:
        """Accept `count` tokens: mostly what the processor would let greedy pick, some random."""
        tokens = []
        for _ in range(count):
            if rng.random() < 0.2:
                token = rng.randrange(self._context.vocab_size)
            else:
                token = int(self._apply(processor, self._logits(rng, 1), [state])[0].argmax())
            processor.accept(state, token)
            tokens.append(token)
        return tokens

    # ------------------------------------------------------------ tests

    def test_implements_protocol(self, processor):
        check(isinstance(processor, LogitsProcessor), IMPLEMENTS, f"{type(processor).__name__}")

    def test_no_effect_when_not_requested(self, processor):
        check(not isinstance(processor, SelfSelectingProcessor) or not processor.is_requested(SamplingParams()),
              NOT_REQUESTED)

    def test_requests_select_it(self, processor):
        name = self.plugin_name
        for params in self._requests():
            by_field = isinstance(processor, SelfSelectingProcessor) and processor.is_requested(params)
            check(by_field or (name is not None and name in params.logits_processors), REQUESTED, repr(params))

    def test_batch_independent(self, processor):
        from hypothesis import given, strategies as st

        requests = self._requests()

        @self.hypothesis_settings()
        @given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 5))
        def run(seed, rows):
            rng = random.Random(seed)
            with exercising(BATCH_INDEPENDENT):
                states = []
                for row in range(rows):
                    state = self.new_state(processor, requests[rng.randrange(len(requests))], f"req-{row}")
                    self._advance(processor, state, rng, rng.randrange(self.steps))
                    states.append(state)
                logits = self._logits(rng, rows)
                batched = self._apply(processor, logits, states)
                for row, state in enumerate(states):
                    alone = self._apply(processor, logits[row: row + 1], [state])
                    check(_same(batched[row], alone[0]), BATCH_INDEPENDENT,
                          f"row {row} of {rows} differs from the row processed alone")

        run()

    def test_rollback_is_exact(self, processor):
        from hypothesis import given, strategies as st

        requests = self._requests()

        @self.hypothesis_settings()
        @given(seed=st.integers(0, 2**32 - 1), kept=st.integers(0, 4), drafts=st.integers(1, 4))
        def run(seed, kept, drafts):
            rng = random.Random(seed)
            params = requests[rng.randrange(len(requests))]
            with exercising(ROLLBACK):
                state = self.new_state(processor, params)
                self._advance(processor, state, rng, kept)
                probe = self._logits(rng, 1)
                before = self._apply(processor, probe, [state])
                self._advance(processor, state, rng, drafts)  # drafts accepted tentatively ...
                processor.rollback(state, drafts)  # ... and rejected
                after = self._apply(processor, probe, [state])
            check(_same(before[0], after[0]), ROLLBACK, f"{kept} kept, {drafts} rolled back")

        run()

    def test_states_are_deterministic(self, processor):
        rng = random.Random(7)
        for params in self._requests():
            with exercising(DETERMINISTIC):
                first, second = self.new_state(processor, params, "a"), self.new_state(processor, params, "b")
                tokens = self._advance(processor, first, rng, self.steps)
                for token in tokens:
                    processor.accept(second, token)
                probe = self._logits(rng, 1).repeat(2, 1)
                out = self._apply(processor, probe, [first, second])
            check(_same(out[0], out[1]), DETERMINISTIC, repr(params))


def _same(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b)) or bool(torch.allclose(a, b, rtol=0, atol=1e-6, equal_nan=True))

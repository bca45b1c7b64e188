"""Contracts for what spoils measurements: a scheduler that starves a request, and a
lookup drafter that proposes the wrong thing, fail with the request or invariant named."""

from __future__ import annotations

import pytest

from servelab.testing import ContractViolation, DrafterContract, SchedulerContract
from servelab_sjf.lookup import LookupOptions, RepeatLookupDrafter
from servelab_sjf.sjf import SJFOptions, SJFScheduler


def contract(cls, factory, options):
    instance = cls()
    instance._factory, instance._options = factory, options
    return instance


def test_a_starving_scheduler_fails_liveness_naming_the_request():
    starving = contract(SchedulerContract, SJFScheduler, SJFOptions(aging_tokens_per_s=0.0))  # pure SJF
    with pytest.raises(ContractViolation, match="invariant violated: no request starves: request 'long'"):
        starving.test_no_request_starves()
    contract(SchedulerContract, SJFScheduler, SJFOptions()).test_no_request_starves()  # aged: served


class RestatingLookup(RepeatLookupDrafter):
    """The bug: proposes the matched n-gram itself, not what followed it."""

    def _draft(self, tokens):
        n = min(self.options.max_ngram, len(tokens) - 1)
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start:start + n]
        return []


class OffByOneLookup(RepeatLookupDrafter):
    """The bug: skips the first token of the continuation."""

    def _draft(self, tokens):
        return super()._draft(tokens)[1:]


class EchoingLookup(RepeatLookupDrafter):
    """The bug: proposes the last k accepted tokens whenever the last n-gram occurred before."""

    def _draft(self, tokens):
        return tokens[-self.options.num_speculative_tokens:] if super()._draft(tokens) else []


@pytest.mark.parametrize("k", range(1, 9))
def test_a_correct_lookup_drafter_passes_the_lookup_rules_for_every_k(k):
    """k = 5 on the 5-periodic context proposes [14 15 11 12 13], the last five tokens and
    the true continuation: right, not a restatement."""
    from servelab.plugins.drafters.ngram import NgramDrafter
    from servelab.plugins.drafters.options import NgramOptions

    for factory, options in ((RepeatLookupDrafter, LookupOptions(num_speculative_tokens=k)),
                             (NgramDrafter, NgramOptions(num_speculative_tokens=k))):
        correct = contract(DrafterContract, factory, options)
        correct.lookup_drafter = True
        correct.test_lookup_proposes_the_known_continuation()


@pytest.mark.parametrize("k", range(1, 9))
def test_a_drafter_echoing_the_last_tokens_is_caught_for_every_k(k):
    broken = contract(DrafterContract, EchoingLookup, LookupOptions(num_speculative_tokens=k))
    broken.lookup_drafter = True
    with pytest.raises(ContractViolation, match="invariant violated: drafts do not restate accepted tokens"):
        broken.test_lookup_proposes_the_known_continuation()


@pytest.mark.parametrize("drafter, invariant", [
    (RestatingLookup, "drafts do not restate accepted tokens"),
    (OffByOneLookup, "a lookup drafter proposes the known continuation"),
])
def test_a_wrong_lookup_drafter_fails_naming_the_invariant(drafter, invariant):
    broken = contract(DrafterContract, drafter, LookupOptions())
    broken.lookup_drafter = True
    with pytest.raises(ContractViolation, match=f"invariant violated: {invariant}"):
        broken.test_lookup_proposes_the_known_continuation()

"""Workload prompts are drawn in bulk, yet are exactly what random.randrange would draw."""

from __future__ import annotations

import random

import pytest

from servelab.workload import FIRST_TOKEN_ID, _tokens


@pytest.mark.parametrize("vocab_size", [FIRST_TOKEN_ID + 1, 500, 8192, 128256, 2**40])
def test_workload_tokens_are_randranges_draws(vocab_size):
    fast, reference = random.Random(7), random.Random(7)
    tokens = _tokens(fast, vocab_size, 2000)
    assert tokens == [reference.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(2000)]
    assert fast.random() == reference.random()  # the generator is left where randrange leaves it


def test_an_empty_vocabulary_fails_like_randrange():
    with pytest.raises(ValueError):
        _tokens(random.Random(0), FIRST_TOKEN_ID, 1)

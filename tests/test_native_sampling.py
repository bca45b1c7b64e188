"""The cpu-paged library's draw straight from logits (cpu_sampling.cpp), which the sampler
takes for rows that only scale by a temperature once the library is loaded.

Checked against float64 inverse transform with the same uniform numbers (a draw may differ
only where the uniform lies within float32 rounding of a boundary between two tokens),
against the exact distribution (chi-square), on masked tokens (never drawn), for batch
independence, and in the engine: the backend offers the library, and a seeded request
gives the same tokens alone and in a batch on that path.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from servelab import LLM, SamplingParams
from servelab.plugins.kernels.cpu_build import kernel_build
from servelab.sampler import sample
from servelab.sampling_stage import sampling_kernels_of

from kernel_cache import HAS_COMPILER

pytestmark = pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler: the sampler draws on the torch path")


@pytest.fixture(scope="module")
def kernels():
    library = kernel_build().wait()
    assert library is not None, "the kernels did not build"
    return library


def _float64_inverse_transform(logits: torch.Tensor, temperature: float, uniform: torch.Tensor):
    """Each row's cumulative probabilities in float64 and its target u (a fraction of the mass)."""
    cdf = torch.softmax(logits.double() / temperature, dim=-1).cumsum(dim=-1)
    return cdf / cdf[:, -1:], uniform.double()


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
@pytest.mark.parametrize("vocab", [49_152, 100, 7], ids=["real", "tail", "shorter_than_a_vector"])
def test_draws_are_float64_inverse_transform_with_the_same_uniforms(kernels, temperature, vocab):
    """Each draw is the token whose float64 interval holds the row's target, up to float32
    rounding of the running sum (1e-4 of the mass: thousands of terms); where the target is
    clear of every boundary by more, exactly that token."""
    generator = torch.Generator().manual_seed(vocab)
    logits = 2.0 * torch.randn(64, vocab, generator=generator)
    logits[:32, : min(vocab, 12)] += 12.0  # peaked rows, as a trained model's
    uniform = torch.rand(64, generator=generator)
    native = kernels.draw_from_logits(logits, torch.full((64,), 1 / temperature), uniform).tolist()
    cdf, target = _float64_inverse_transform(logits, temperature, uniform)
    slack = 1e-4
    clear_rows = 0
    for row, token in enumerate(native):
        low = float(cdf[row, token - 1]) if token > 0 else 0.0
        high = float(cdf[row, token])
        assert low - slack <= float(target[row]) < high + slack, (row, token)
        if float((cdf[row] - target[row]).abs().min()) > slack:
            clear_rows += 1
            assert low <= float(target[row]) < high, (row, token)
    assert clear_rows >= 8


def test_draws_follow_the_distribution(kernels):
    """Four tokens of a 49,152-token row carry all but a sliver of the mass at T = 0.5:
    40,000 draws match their rates (chi-square, 3 degrees of freedom)."""
    vocab, n = 49_152, 40_000
    row = torch.full((vocab,), -30.0)
    chosen = {17: 0.5, 20_000: 0.3, 20_001: 0.15, vocab - 2: 0.05}
    for token, p in chosen.items():
        row[token] = 0.5 * math.log(p)  # at T = 0.5 the weights are p
    logits = row.expand(n, vocab)  # one row read n times (a row stride of 0), not 8 GB
    uniform = torch.rand(n, generator=torch.Generator().manual_seed(3))
    counts = Counter(kernels.draw_from_logits(logits, torch.full((n,), 2.0), uniform).tolist())
    assert set(counts) <= set(chosen)
    statistic = sum((counts.get(t, 0) - n * p) ** 2 / (n * p) for t, p in chosen.items())
    assert math.exp(-statistic / 2) * (1 + statistic / 2) > 1e-4  # P(chi2 >= statistic) at 4 df (as tests/test_sampler.py)


@pytest.mark.parametrize("allowed", [[5, 700, 2_049, 4_095], [86, 498, 2_979], [3_000], [17, 18, 19]])
def test_masked_tokens_are_never_drawn(kernels, allowed):
    """A token a grammar or a ban set to -inf has no weight at all, wherever the allowed
    tokens sit (every lane of a vector, not only the first, holds the row's maximum)."""
    vocab, n = 4_096, 2_000
    logits = torch.full((n, vocab), float("-inf"))
    logits[:, allowed] = torch.linspace(2.0, -3.0, len(allowed))
    uniform = torch.rand(n, generator=torch.Generator().manual_seed(4))
    drawn = set(kernels.draw_from_logits(logits, torch.ones(n), uniform).tolist())
    assert drawn == set(allowed)


def test_a_row_draws_the_same_token_in_any_batch(kernels):
    generator = torch.Generator().manual_seed(5)
    logits = 3.0 * torch.randn(40, 1_000, generator=generator)
    uniform = torch.rand(40, generator=generator)
    scale = torch.linspace(0.5, 2.0, 40)
    batched = kernels.draw_from_logits(logits, scale, uniform)
    alone = [int(kernels.draw_from_logits(logits[i:i + 1], scale[i:i + 1], uniform[i:i + 1])) for i in range(40)]
    assert batched.tolist() == alone


def test_the_sampler_keeps_filtered_and_greedy_rows_on_their_own_paths(kernels):
    """With the library, temperature-only rows take it; top-k / top-p / min-p rows keep the
    torch filters (the kept set is theirs), greedy rows their argmax."""
    generator = torch.Generator().manual_seed(6)
    logits = 2.0 * torch.randn(6, 300, generator=generator)
    logits[3, 17] += 9.0  # one token holds nearly all the mass: top-p 0.5 and min-p 0.9 keep it alone
    logits[4, 42] += 9.0
    params = [SamplingParams(temperature=0), SamplingParams(top_k=2), SamplingParams(temperature=0.8),
              SamplingParams(top_p=0.5), SamplingParams(min_p=0.9), SamplingParams()]
    for seed in range(30):
        with_library = sample(logits, params, [None] * 6, torch.Generator().manual_seed(seed), kernels)
        assert with_library[0] == int(logits[0].argmax())
        assert with_library[1] in logits[1].topk(2).indices.tolist()
        assert with_library[3] == 17 and with_library[4] == 42


def test_the_engine_draws_on_the_library_and_seeded_requests_still_reproduce(kernels, llama_checkpoint):
    llm = LLM(llama_checkpoint, max_model_len=128, **{"attention.name": "cpu-paged", "attention.build": "wait"})
    assert sampling_kernels_of(llm.engine.attention)() is not None
    seeded = SamplingParams(max_tokens=8, temperature=0.9, seed=11, ignore_eos=True)
    alone = llm.generate([[3, 4, 5, 6]], seeded)[0].token_ids
    others = [SamplingParams(max_tokens=8, temperature=1.3, ignore_eos=True)] * 5
    batch = llm.generate([[3, 4, 5, 6]] + [[7 + i, 8, 9] for i in range(5)], [seeded] + others)
    assert batch[0].token_ids == alone

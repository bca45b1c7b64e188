"""The lossless verification rule, alone: emitted tokens follow the target distribution
p whatever the draft distribution q (checked statistically with fixed seeds), greedy
verification is exact-match, and seeded requests reproduce."""

from __future__ import annotations

import pytest
import torch

from servelab.sampler import filtered_probs
from servelab.sampling_params import SamplingParams
from servelab.verification import verify

TRIALS = 20_000
P_VALUE = 1e-3  # a correct sampler fails one of these tests about once in a thousand seeds


def chi_square_p_value(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Goodness of fit over the categories with non-zero expected probability; a category
    with zero probability that was observed fails outright."""
    total = observed.sum()
    support = expected_probs > 0
    assert observed[~support].sum() == 0, f"emitted tokens with zero target probability: {observed}"
    expected = expected_probs[support].double() * total
    stat = ((observed[support].double() - expected) ** 2 / expected).sum()
    dof = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def logits_for(probs: list[float]) -> torch.Tensor:
    p = torch.tensor(probs, dtype=torch.float64)
    return torch.where(p > 0, p.log(), torch.tensor(-float("inf"), dtype=torch.float64)).float()


# (p, q) pairs chosen to break a wrong rule: q peaked where p is flat, q flat where p is
# peaked, q putting mass where p has none, and disjoint supports.
PAIRS = {
    "q-peaked": ([0.2, 0.2, 0.2, 0.2, 0.2], [0.85, 0.05, 0.04, 0.03, 0.03]),
    "p-peaked": ([0.7, 0.1, 0.1, 0.05, 0.05], [0.2, 0.2, 0.2, 0.2, 0.2]),
    "q-mass-where-p-has-none": ([0.5, 0.5, 0.0, 0.0, 0.0], [0.1, 0.1, 0.4, 0.2, 0.2]),
    "disjoint": ([0.0, 0.0, 0.3, 0.7, 0.0], [0.6, 0.4, 0.0, 0.0, 0.0]),
    "equal": ([0.1, 0.2, 0.3, 0.4, 0.0], [0.1, 0.2, 0.3, 0.4, 0.0]),
}


def run_trials(p_rows: list[list[float]], q_rows: list[list[float]] | None, draft_rows: torch.Tensor,
               params: SamplingParams, seed: int = 0):
    """One verify call over TRIALS sequences sharing the same p rows (k drafts + bonus)."""
    k = draft_rows.shape[1]
    logits = torch.stack([logits_for(p) for p in p_rows]).repeat(TRIALS, 1)  # [(k + 1) * TRIALS, V]
    q = torch.tensor(q_rows, dtype=torch.float32) if q_rows is not None else None
    return verify(logits, draft_rows.tolist(), [q] * TRIALS if q is not None else [None] * TRIALS,
                  [params] * TRIALS, [None] * TRIALS, torch.Generator().manual_seed(seed)), k


@pytest.mark.parametrize("pair", sorted(PAIRS))
def test_first_emitted_token_follows_p(pair):
    p, q = PAIRS[pair]
    drafts = torch.multinomial(torch.tensor(q), TRIALS, replacement=True, generator=torch.Generator().manual_seed(1))
    results, _ = run_trials([p, p], [q], drafts[:, None], SamplingParams(temperature=1.0))
    first = torch.tensor([r.token_ids[0] for r in results])
    assert chi_square_p_value(torch.bincount(first, minlength=len(p)), torch.tensor(p)) > P_VALUE


def test_deterministic_draft_follows_p():
    """A lookup drafter's proposal is a one-hot q: accepted with probability p(d)."""
    p = [0.05, 0.6, 0.15, 0.2, 0.0]
    drafts = torch.full((TRIALS, 1), 0)  # the least likely token is always proposed
    results, _ = run_trials([p, p], None, drafts, SamplingParams(temperature=1.0))
    first = torch.tensor([r.token_ids[0] for r in results])
    assert chi_square_p_value(torch.bincount(first, minlength=len(p)), torch.tensor(p)) > P_VALUE
    accepted = sum(r.num_accepted for r in results) / TRIALS
    assert abs(accepted - 0.05) < 4 * (0.05 * 0.95 / TRIALS) ** 0.5


def test_after_acceptance_the_next_token_follows_the_next_row():
    """With two drafts, given the first draft was accepted, the second emitted token is
    distributed as the second row of p (the bonus or the residual path)."""
    p0, p1, p2 = [0.3, 0.3, 0.2, 0.2, 0.0], [0.05, 0.05, 0.1, 0.2, 0.6], [0.25] * 4 + [0.0]
    q0, q1 = [0.4, 0.1, 0.1, 0.1, 0.3], [0.6, 0.1, 0.1, 0.1, 0.1]
    gen = torch.Generator().manual_seed(2)
    drafts = torch.stack([torch.multinomial(torch.tensor(q), TRIALS, replacement=True, generator=gen)
                          for q in (q0, q1)], dim=1)
    results, _ = run_trials([p0, p1, p2], [q0, q1], drafts, SamplingParams(temperature=1.0))
    second = torch.tensor([r.token_ids[1] for r in results if r.num_accepted >= 1])
    assert len(second) > TRIALS // 4
    assert chi_square_p_value(torch.bincount(second, minlength=5), torch.tensor(p1)) > P_VALUE


def test_filters_apply_to_p():
    """top-k = 2 at temperature 0.5: emitted tokens follow the filtered p, never a cut token."""
    p = [0.4, 0.3, 0.2, 0.1, 0.0]
    params = SamplingParams(temperature=0.5, top_k=2)
    filtered = filtered_probs(logits_for(p)[None], [params])[0]
    q = [0.1, 0.1, 0.3, 0.3, 0.2]
    drafts = torch.multinomial(torch.tensor(q), TRIALS, replacement=True, generator=torch.Generator().manual_seed(3))
    results, _ = run_trials([p, p], [q], drafts[:, None], params)
    first = torch.tensor([r.token_ids[0] for r in results])
    assert chi_square_p_value(torch.bincount(first, minlength=5), filtered) > P_VALUE


def test_the_check_detects_a_wrong_rule():
    """Guard on the guard: emitting the draft itself (always accepting) is caught."""
    p, q = PAIRS["q-peaked"]
    drafts = torch.multinomial(torch.tensor(q), TRIALS, replacement=True, generator=torch.Generator().manual_seed(1))
    assert chi_square_p_value(torch.bincount(drafts, minlength=5), torch.tensor(p)) < P_VALUE


def test_greedy_accepts_the_longest_matching_prefix_then_the_argmax():
    vocab = 6
    rows = torch.full((4 + 3, vocab), -5.0)
    argmax = [2, 4, 1, 5, 3, 0, 1]  # seq A: rows 0-3 (3 drafts + bonus), seq B: rows 4-6
    for row, token in enumerate(argmax):
        rows[row, token] = 5.0
    greedy = SamplingParams(temperature=0)
    results = verify(rows, [[2, 4, 0], [3, 0]], [None, None], [greedy, greedy], [None, None])
    assert results[0].token_ids == [2, 4, 1] and results[0].num_accepted == 2
    assert results[1].token_ids == [3, 0, 1] and results[1].num_accepted == 2  # all accepted, then the bonus


def test_seeded_requests_reproduce_whatever_the_batch():
    params = SamplingParams(temperature=1.0, seed=5)
    torch.manual_seed(0)
    logits = torch.randn(3, 7)
    alone = verify(logits, [[1, 2]], [None], [params], [torch.Generator().manual_seed(5)])
    other = torch.randn(4, 7)  # a neighbour with more drafts: padding must not shift the draws
    batched = verify(torch.cat([other, logits]), [[0, 3, 1], [1, 2]], [None, None],
                     [SamplingParams(temperature=1.0), params],
                     [torch.Generator().manual_seed(9), torch.Generator().manual_seed(5)])
    assert batched[1] == alone[0]

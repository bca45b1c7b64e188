"""Turning next-token logits into tokens: greedy, temperature, top-k, top-p, min-p.

A row's token is drawn by inverse transform (`draw`): one uniform number from the row's
own generator, found in the row's cumulative probabilities. A seeded request draws once a
step from its own generator and reproduces exactly whatever else shares its batch. (An
exponential race, argmax of p / E, needs a random number per vocabulary entry: 83 ms a
step for 96 rows of a 49,152-token vocabulary on two cores, against 2 ms for this.)
"""

from __future__ import annotations

from typing import Sequence as Seq

import torch

from servelab.sampling_params import SamplingParams


def sample(
    logits: torch.Tensor,  # [S, vocab] float32
    params: Seq[SamplingParams],
    generators: Seq[torch.Generator | None],  # per row; None draws from `default_generator`
    default_generator: torch.Generator | None = None,
) -> list[int]:
    """One token per row."""
    if all(p.is_greedy for p in params):
        return greedy_tokens(logits)
    tokens = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.is_greedy]
    random_rows = torch.tensor(rows, device=logits.device)
    probs = filtered_probs(logits[random_rows], [params[i] for i in rows])
    tokens[random_rows] = draw(probs, [generators[row] for row in rows], default_generator)
    return tokens.tolist()


def draw(probs: torch.Tensor, generators: Seq[torch.Generator | None],
         default_generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of `probs` [R, vocab] (each row a distribution, up to rounding):
    a uniform u from the row's generator (None: `default_generator`), then the first token
    whose cumulative probability exceeds u times the row's total, so a token of probability
    zero is never drawn. [R] int64."""
    uniform = torch.empty(probs.shape[0], 1, dtype=probs.dtype, device=probs.device)
    for row, generator in enumerate(generators):
        uniform[row].uniform_(generator=generator or default_generator)
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    # strictly below the total, so that the position found has mass of its own
    target = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """The argmax of each row [S, vocab] (the first one on ties, as torch's).

    On the CPU numpy's vectorised argmax is much cheaper than torch's at serving batch
    sizes (docs/performance.md, "Greedy sampling through numpy's argmax")."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return logits.detach().numpy().argmax(axis=-1).tolist()
    return logits.argmax(dim=-1).tolist()


def filtered_probs(logits: torch.Tensor, params: Seq[SamplingParams]) -> torch.Tensor:
    """Probabilities after temperature, top-k, top-p and min-p, renormalised. [S, vocab]"""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device, dtype=logits.dtype)
    logits = logits / temperature[:, None]
    if any(p.top_k > 0 or p.top_p < 1 for p in params):
        logits = _top_k_top_p(logits, params)
    probs = torch.softmax(logits, dim=-1)
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=device, dtype=probs.dtype)
        filtered = probs.masked_fill(probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True), 0.0)
        filtered = filtered / filtered.sum(dim=-1, keepdim=True)
        # Rows without min-p keep their softmax bit for bit, whatever their batch holds.
        probs = torch.where(min_p[:, None] > 0, filtered, probs)
    return probs


def _top_k_top_p(logits: torch.Tensor, params: Seq[SamplingParams]) -> torch.Tensor:
    vocab = logits.shape[-1]
    device = logits.device
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=device)
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
    remove = rank[None, :] >= top_k[:, None]
    top_p = torch.tensor([p.top_p for p in params], device=device, dtype=logits.dtype)
    sorted_probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
    # Keep the smallest prefix whose mass reaches top_p: drop a token once the mass
    # before it already does. The first token always stays. Rows with top_p = 1 cut
    # nothing: their float32 cumsum can round up to 1.0 before the tail ends.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    remove |= (mass_before >= top_p[:, None]) & (top_p[:, None] < 1)
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)

"""Turning next-token logits into tokens: greedy, temperature, top-k, top-p, min-p.

A row's token is drawn by inverse transform (`draw`): one uniform number from the row's
own generator, found in the row's cumulative probabilities. A seeded request draws once a
step from its own generator and reproduces exactly whatever else shares its batch. (An
exponential race, argmax of p / E, needs a random number per vocabulary entry: 83 ms a
step for 96 rows of a 49,152-token vocabulary on two cores, against 2 ms for this.)
"""

from __future__ import annotations

from typing import Any, Sequence as Seq

import torch

from servelab.sampling_params import SamplingParams


def sample(
    logits: torch.Tensor,  # [S, vocab] float32
    params: Seq[SamplingParams],
    generators: Seq[torch.Generator | None],  # per row; None draws from `default_generator`
    default_generator: torch.Generator | None = None,
    kernels: Any = None,  # a library with `draw_from_logits` (servelab.interfaces.SamplingKernelsBackend)
) -> list[int]:
    """One token per row. Greedy rows take their argmax and random rows their draw, each
    computed on its own rows only (a full-batch argmax costs as much as the draw).

    Random rows draw their uniforms in row order (each from its own generator), then either
    the native library draws them straight from their logits (`kernels`, when every row only
    scales by a temperature: no top-k, top-p or min-p; the same rule, the weights summed in
    its own order), or a chunk of rows at a time is filtered and drawn: a chunk's
    probabilities and their cumulative sums (3 MB, 16 rows of a 49,152-token vocabulary)
    stay in cache between the passes, where a whole batch's would be fresh pages each step.
    Rows are independent, so the tokens are the same either way."""
    greedy = [i for i, p in enumerate(params) if p.is_greedy]
    if len(greedy) == len(params):
        return greedy_tokens(logits)
    every_row = logits
    drawn_rows = [i for i, p in enumerate(params) if not p.is_greedy] if greedy else range(len(params))
    if greedy:
        index = torch.tensor(drawn_rows, device=logits.device)
        logits, params, generators = logits[index], [params[i] for i in drawn_rows], [generators[i] for i in drawn_rows]
    uniform = torch.empty(logits.shape[0], 1, dtype=logits.dtype, device=logits.device)  # one per row
    if all(generator is None for generator in generators):  # one call: the same numbers, row by row
        uniform.uniform_(generator=default_generator)
    else:
        for row, generator in enumerate(generators):
            uniform[row].uniform_(generator=generator or default_generator)
    if (kernels is not None and logits.device.type == "cpu" and logits.dtype == torch.float32
            and logits.stride(-1) == 1 and not any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params)):
        inverse_temperature = torch.tensor([1.0 / p.temperature for p in params], dtype=torch.float32)
        drawn = kernels.draw_from_logits(logits, inverse_temperature, uniform.view(-1)).tolist()
    else:
        drawn = []
        chunk_rows = max(1, DRAW_CHUNK_ELEMENTS // logits.shape[-1])
        for first in range(0, logits.shape[0], chunk_rows):
            last = first + chunk_rows
            probs = filtered_probs(logits[first:last], params[first:last])
            drawn += draw(probs, uniform[first:last]).tolist()
    if not greedy:
        return drawn
    tokens = [0] * (len(drawn) + len(greedy))
    for row, token_id in zip(drawn_rows, drawn):
        tokens[row] = token_id
    for row, token_id in zip(greedy, greedy_tokens(every_row[torch.tensor(greedy, device=every_row.device)])):
        tokens[row] = token_id
    return tokens


DRAW_CHUNK_ELEMENTS = 16 * 49_152  # 3 MB of float32: a chunk's passes stay in cache


def draw(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One token per row of `probs` [R, vocab] (each row a distribution, up to rounding):
    the first token whose cumulative probability exceeds the row's uniform number
    (`uniform` [R, 1], in [0, 1), drawn from the row's generator) times the row's total, so
    a token of probability zero is never drawn. [R] int64."""
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
    if any(p.temperature != 1.0 for p in params):
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


NUCLEUS_CANDIDATES = 64  # a top-p row looks for its cut among its most likely tokens first
MAX_TOP_K_CANDIDATES = 1024  # past this, a top-k row is cheaper sorted in full


def _top_k_top_p(logits: torch.Tensor, params: Seq[SamplingParams]) -> torch.Tensor:
    """The logits with every token top-k and top-p remove set to -inf.

    A full sort of a 49,152-token row costs ~3.4 ms (160 ms for 96 rows on two cores);
    `topk` of 64 costs a thirtieth of that. So each row first takes its candidates, the
    most likely tokens in order: its top_k of them, or NUCLEUS_CANDIDATES for a nucleus
    without top-k. A row whose cut falls inside its candidates (the usual case: the
    nucleus of a trained model's distribution is small) is done there; the rest are
    sorted in full. Which path a row takes depends on that row alone, so its kept set
    never depends on what else is in the batch."""
    vocab = logits.shape[-1]
    by_filter: dict[tuple[int, float], list[int]] = {}
    for row, p in enumerate(params):
        by_filter.setdefault((p.top_k, p.top_p), []).append(row)
    by_width: dict[int, list[int]] = {}
    untouched: list[int] = []
    in_full: list[int] = []
    for (top_k, top_p), rows in by_filter.items():
        top_k = top_k if 0 < top_k < vocab else vocab
        width = top_k if top_k < vocab else min(vocab, NUCLEUS_CANDIDATES)
        if top_p >= 1 and top_k == vocab:
            untouched += rows  # nothing to cut (a companion's filter brought them here)
        elif width <= (MAX_TOP_K_CANDIDATES if top_p >= 1 else NUCLEUS_CANDIDATES) or top_k == vocab:
            by_width.setdefault(width, []).extend(rows)
        else:
            in_full += rows
    if len(by_width) == 1 and not untouched and not in_full:  # the usual batch: one filter for every row
        (width,) = by_width
        kept, unresolved = _cut_among_candidates(logits, params, width, vocab)
        if not unresolved:
            return kept
    filtered = torch.full_like(logits, float("-inf"))
    if untouched:
        index = torch.tensor(untouched, device=logits.device)
        filtered[index] = logits[index]
    for width, rows in by_width.items():
        rows.sort()
        index = torch.tensor(rows, device=logits.device)
        kept, unresolved = _cut_among_candidates(logits[index], [params[row] for row in rows], width, vocab)
        unresolved_set = set(unresolved)
        resolved = [i for i in range(len(rows)) if i not in unresolved_set]
        filtered[index[resolved]] = kept[resolved]
        in_full += [rows[i] for i in unresolved]
    if in_full:
        in_full.sort()
        index = torch.tensor(in_full, device=logits.device)
        filtered[index] = _sorted_top_k_top_p(logits[index], [params[row] for row in in_full])
    return filtered


def _cut_among_candidates(logits: torch.Tensor, params: Seq[SamplingParams], width: int,
                          vocab: int) -> tuple[torch.Tensor, list[int]]:
    """The rows' logits with what top-k and top-p remove set to -inf, found among each
    row's `width` most likely tokens; and the rows whose cut lies beyond those (their
    result is not valid)."""
    values, order = logits.topk(width, dim=-1)  # descending
    device, dtype = logits.device, logits.dtype
    kept = torch.full_like(logits, float("-inf"))
    nucleus = [p.top_p < 1 for p in params]
    if not any(nucleus):
        return kept.scatter_(-1, order, values), []
    top_p = torch.tensor([p.top_p for p in params], device=device, dtype=dtype)
    whole = [not 0 < p.top_k < vocab for p in params]
    # Top-p renormalises over what top-k kept: the candidates themselves when top-k set
    # them, the whole vocabulary otherwise (whose largest logit is the first candidate).
    if any(whole):
        peak = values[:, :1]
        total = peak.squeeze(1) + (logits - peak).exp_().sum(dim=-1).log_()
        if not all(whole):
            total = torch.where(torch.tensor(whole, device=device), total, torch.logsumexp(values, dim=-1))
    else:
        total = torch.logsumexp(values, dim=-1)
    probs = torch.exp(values - total[:, None])
    mass_before = probs.cumsum(dim=-1) - probs
    remove = (mass_before >= top_p[:, None]) & torch.tensor(nucleus, device=device)[:, None]
    remove[:, 0] = False
    kept.scatter_(-1, order, values.masked_fill_(remove, float("-inf")))
    # A nucleus over the whole vocabulary is found only if the candidates reach top_p:
    # every token past them then has at least that much mass before it.
    reached = (probs.sum(dim=-1) >= top_p).tolist()
    unresolved = [row for row in range(len(params)) if nucleus[row] and whole[row] and not reached[row]]
    return kept, unresolved


def _sorted_top_k_top_p(logits: torch.Tensor, params: Seq[SamplingParams]) -> torch.Tensor:
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

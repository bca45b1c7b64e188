"""Lossless verification of drafted tokens (Leviathan et al. 2023; Chen et al. 2023).

One target pass scores each sequence's k drafts plus a bonus position: logits row j is
the target's next-token distribution p_j after the verified tokens and drafts d_1..d_j.

- Greedy requests accept the longest prefix of drafts equal to the target's argmax, then
  append the target's argmax at the first mismatch (or at the bonus position): exactly
  the tokens greedy decoding without drafts produces.
- Sampled requests accept d_j with probability min(1, p_j(d_j) / q_j(d_j)), where q_j is
  the distribution the drafter drew d_j from (one-hot for deterministic drafters). At
  the first rejection the token is drawn from the normalised residual max(0, p_j - q_j);
  after all k are accepted, the bonus token is drawn from p_k. Every emitted token is
  then distributed exactly as the target's own sample would be.

p is filtered by temperature, top-k, top-p and min-p exactly as without speculation
(`sampler.filtered_probs`); a drafter that samples applies the same filters to q.
Each request's random draws come from its own generator, so seeded requests reproduce.
Drafts that form a token tree are verified by the multi-candidate rule of
servelab.tree_verification, of which this chain rule is the one-branch case.
"""

from __future__ import annotations

from typing import Sequence as Seq

import attrs
import torch

from servelab.sampler import draw, filtered_probs, greedy_tokens
from servelab.sampling_params import SamplingParams
from servelab.tree_verification import verify_trees


@attrs.frozen
class Verified:
    """What verification decided for one sequence."""

    token_ids: list[int]  # accepted drafts followed by one target token
    num_accepted: int
    # A token tree's accepted root path, as node indices (servelab.token_tree); None for a
    # chain, whose accepted drafts are its first num_accepted.
    path: tuple[int, ...] | None = None


def verify(
    logits: torch.Tensor,  # [sum(k_i + 1), vocab] float32: k_i + 1 rows per sequence, in order
    draft_token_ids: Seq[Seq[int]],  # k_i >= 1 drafts per sequence
    draft_probs: Seq[torch.Tensor | None],  # q [k_i, vocab] per sequence, None for deterministic drafts
    params: Seq[SamplingParams],
    generators: Seq[torch.Generator | None],  # per sequence; None draws from default_generator
    default_generator: torch.Generator | None = None,
    # Per sequence, the parents of its drafts when they form a token tree
    # (servelab.tree_verification), None for a chain; None: every draft is a chain.
    draft_parents: Seq[Seq[int] | None] | None = None,
) -> list[Verified]:
    num_seqs = len(draft_token_ids)
    results: list[Verified | None] = [None] * num_seqs
    starts = [0] * num_seqs
    for r in range(1, num_seqs):
        starts[r] = starts[r - 1] + len(draft_token_ids[r - 1]) + 1
    trees = [r for r in range(num_seqs) if draft_parents is not None and draft_parents[r] is not None]
    if trees:
        verified_trees = verify_trees(logits, [starts[r] for r in trees], [draft_token_ids[r] for r in trees],
                                      [draft_parents[r] for r in trees], [draft_probs[r] for r in trees],
                                      [params[r] for r in trees],
                                      [generators[r] or default_generator for r in trees])
        for r, (tokens, path) in zip(trees, verified_trees):
            results[r] = Verified(tokens, len(path), path)
        if len(trees) == num_seqs:
            return results
    chains = [r for r in range(num_seqs) if results[r] is None]
    greedy = [r for r in chains if params[r].is_greedy]
    if greedy:  # exact match against the argmax: a handful of Python comparisons per sequence
        argmax = greedy_tokens(logits)
        for r in greedy:
            drafts = list(draft_token_ids[r])
            target = argmax[starts[r]: starts[r] + len(drafts) + 1]
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == target[accepted]:
                accepted += 1
            results[r] = Verified(drafts[:accepted] + [target[accepted]], accepted)
    sampled = [r for r in chains if not params[r].is_greedy]
    if sampled:
        rows = [starts[r] + j for r in sampled for j in range(len(draft_token_ids[r]) + 1)]
        verified = _verify_sampled(logits[torch.tensor(rows, dtype=torch.int64, device=logits.device)],
                                   [draft_token_ids[r] for r in sampled], [draft_probs[r] for r in sampled],
                                   [params[r] for r in sampled], [generators[r] or default_generator for r in sampled])
        for r, result in zip(sampled, verified):
            results[r] = result
    return results


def _verify_sampled(logits: torch.Tensor, draft_token_ids: list[Seq[int]], draft_probs: list[torch.Tensor | None],
                    params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[Verified]:
    """The min(1, p/q) rule, vectorised over sequences (padded to the longest draft)."""
    device = logits.device
    num_seqs, vocab = len(draft_token_ids), logits.shape[-1]
    lengths = torch.tensor([len(d) for d in draft_token_ids], device=device)
    k = int(lengths.max())
    num_rows = k + 1
    # rows[r, j]: logits row of position j of sequence r (its bonus row repeated as padding).
    starts = torch.cumsum(lengths + 1, 0) - (lengths + 1)
    positions = torch.arange(num_rows, device=device)
    rows = starts[:, None] + torch.minimum(positions[None, :], lengths[:, None])
    drafts = torch.zeros(num_seqs, k, dtype=torch.int64, device=device)
    for r, tokens in enumerate(draft_token_ids):
        drafts[r, : len(tokens)] = torch.tensor(list(tokens), dtype=torch.int64)
    valid = positions[None, :k] < lengths[:, None]
    repeated = [p for p in params for _ in range(num_rows)]
    p = filtered_probs(logits[rows.flatten()], repeated).view(num_seqs, num_rows, vocab)
    p_draft = p[:, :k].gather(2, drafts[:, :, None]).squeeze(2)  # p_j(d_j)
    q_draft = torch.ones_like(p_draft)
    for r, q in enumerate(draft_probs):
        if q is not None:
            n = q.shape[0]
            q_draft[r, :n] = q.to(p.dtype).gather(1, drafts[r, :n, None]).squeeze(1)
    uniform = torch.ones(num_seqs, num_rows, dtype=p.dtype, device=device)
    for r, generator in enumerate(generators):  # k_i + 1 draws each: a request's draws never depend on its batch
        uniform[r, : len(draft_token_ids[r]) + 1].uniform_(generator=generator)
    # u < p / q, written without dividing: accept with probability min(1, p / q).
    accept = (uniform[:, :k] * q_draft < p_draft) & valid
    accepted = accept.long().cumprod(dim=1).sum(dim=1)  # the leading run of accepted drafts
    seq_index = torch.arange(num_seqs, device=logits.device)
    target = p[seq_index, accepted]  # [R, vocab]: p at the first rejection, or the bonus row
    rejected = accepted < valid.sum(dim=1)
    if bool(rejected.any()):
        q_rows = torch.zeros_like(target)
        for r in rejected.nonzero().flatten().tolist():
            j = int(accepted[r])
            if draft_probs[r] is None:
                q_rows[r, drafts[r, j]] = 1.0
            else:
                q_rows[r] = draft_probs[r][j].to(p.dtype)
        residual = (target - q_rows).clamp_(min=0)
        mass = residual.sum(dim=1, keepdim=True)
        # p == q at a rejected position has probability zero; keep p if rounding gets there.
        use_residual = rejected[:, None] & (mass > 0)
        target = torch.where(use_residual, residual / mass.clamp(min=torch.finfo(p.dtype).tiny), target)
    final = draw(target, uniform[seq_index, lengths][:, None]).tolist()  # each row's last number
    counts = accepted.tolist()
    return [Verified(list(draft_token_ids[r][: counts[r]]) + [final[r]], counts[r]) for r in range(num_seqs)]

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
"""

from __future__ import annotations

from typing import Sequence as Seq

import attrs
import torch

from servelab.sampler import filtered_probs
from servelab.sampling_params import SamplingParams


@attrs.frozen
class Verified:
    """What verification decided for one sequence."""

    token_ids: list[int]  # accepted drafts followed by one target token
    num_accepted: int


def verify(
    logits: torch.Tensor,  # [sum(k_i + 1), vocab] float32: k_i + 1 rows per sequence, in order
    draft_token_ids: Seq[Seq[int]],  # k_i >= 1 drafts per sequence
    draft_probs: Seq[torch.Tensor | None],  # q [k_i, vocab] per sequence, None for deterministic drafts
    params: Seq[SamplingParams],
    generators: Seq[torch.Generator | None],  # per sequence; None draws from default_generator
    default_generator: torch.Generator | None = None,
) -> list[Verified]:
    num_seqs = len(draft_token_ids)
    if num_seqs == 0:
        return []
    device = logits.device
    lengths = torch.tensor([len(d) for d in draft_token_ids], device=device)
    k = int(lengths.max())
    # rows[r, j]: logits row of position j of sequence r (its bonus row repeated as padding).
    starts = torch.cumsum(lengths + 1, 0) - (lengths + 1)
    positions = torch.arange(k + 1, device=device)
    rows = starts[:, None] + torch.minimum(positions[None, :], lengths[:, None])
    drafts = torch.zeros(num_seqs, k, dtype=torch.int64, device=device)
    for r, tokens in enumerate(draft_token_ids):
        drafts[r, : len(tokens)] = torch.tensor(list(tokens), dtype=torch.int64)
    valid = positions[None, :k] < lengths[:, None]

    num_accepted = torch.zeros(num_seqs, dtype=torch.int64, device=device)
    final = torch.zeros(num_seqs, dtype=torch.int64, device=device)
    greedy = [r for r in range(num_seqs) if params[r].is_greedy]
    sampled = [r for r in range(num_seqs) if not params[r].is_greedy]
    if greedy:
        index = torch.tensor(greedy, device=device)
        target = logits[rows[index]].argmax(dim=-1)  # [G, k + 1]
        accepted = _accepted_run((target[:, :k] == drafts[index]) & valid[index])
        num_accepted[index] = accepted
        final[index] = target.gather(1, accepted[:, None]).squeeze(1)
    if sampled:
        index = torch.tensor(sampled, device=device)
        accepted, tokens = _verify_sampled(
            logits[rows[index]], drafts[index], valid[index], [draft_probs[r] for r in sampled],
            [params[r] for r in sampled], [generators[r] or default_generator for r in sampled])
        num_accepted[index] = accepted
        final[index] = tokens
    counts = num_accepted.tolist()
    finals = final.tolist()
    return [Verified(list(draft_token_ids[r][: counts[r]]) + [finals[r]], counts[r]) for r in range(num_seqs)]


def _accepted_run(accept: torch.Tensor) -> torch.Tensor:
    """Length of the leading run of True per row. [R, k] bool -> [R] int64"""
    return accept.long().cumprod(dim=1).sum(dim=1)


def _verify_sampled(logits: torch.Tensor, drafts: torch.Tensor, valid: torch.Tensor,
                    draft_probs: list[torch.Tensor | None], params: list[SamplingParams],
                    generators: list[torch.Generator | None]) -> tuple[torch.Tensor, torch.Tensor]:
    num_seqs, num_rows, vocab = logits.shape
    k = num_rows - 1
    repeated = [p for p in params for _ in range(num_rows)]
    p = filtered_probs(logits.reshape(-1, vocab), repeated).view(num_seqs, num_rows, vocab)
    p_draft = p[:, :k].gather(2, drafts[:, :, None]).squeeze(2)  # p_j(d_j)
    q_draft = torch.ones_like(p_draft)
    for r, q in enumerate(draft_probs):
        if q is not None:
            n = q.shape[0]
            q_draft[r, :n] = q.to(p.dtype).gather(1, drafts[r, :n, None]).squeeze(1)
    uniform = torch.empty_like(p_draft)
    for r, generator in enumerate(generators):
        uniform[r].uniform_(generator=generator)
    # u < p / q, written without dividing: accept with probability min(1, p / q).
    accepted = _accepted_run((uniform * q_draft < p_draft) & valid)
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
    noise = torch.empty_like(target)
    for r, generator in enumerate(generators):
        noise[r].exponential_(generator=generator)
    return accepted, (target / noise).argmax(dim=1)

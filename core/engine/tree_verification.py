"""Lossless verification of token trees (SpecInfer, Miao et al. 2024; Sequoia, Chen et
al. 2024): the chain rule of servelab.verification, generalised to several candidates
per position.

Logits row 0 of a sequence is the target's next-token distribution after its verified
tokens (the root); row i + 1 is the distribution after node i's root path.

- Greedy: from the root, descend to the first child whose token equals the target's
  argmax at the current row, while there is one; then append that row's argmax. This is
  the longest root path of the tree that greedy decoding would produce, followed by the
  target's own token: exactly the tokens greedy decoding without drafts produces.
- Sampled (recursive rejection sampling over siblings): at the current row, with the
  target's filtered distribution p, try the children c_1, c_2, ... in order. Child c_j,
  drawn from q_j (its `Draft.probs` row; one-hot for a deterministic drafter), is
  accepted with probability min(1, p(c_j) / q_j(c_j)): then descend to its row and start
  again with that row's p. When c_j is rejected, p becomes the normalised residual
  max(0, p - q_j) and the next sibling is tried against it. When every child was
  rejected (or the row has none), the token is drawn from the current p and the step ends.

Why it is lossless (the proof sketch docs/speculative-decoding.md expands): fix a row and
let H_j be what happened before sibling j (the earlier siblings' tokens and their
rejections), p_j the distribution reached then. Claim: given H_j, the token this row
emits is distributed as p_j. For the last "sibling", the draw from p_j, it is so by
construction. For sibling j, drawn from q_j given H_j: it is emitted as token x with
probability q_j(x) min(1, p_j(x) / q_j(x)) = min(q_j(x), p_j(x)); it is rejected with
probability 1 - sum_x min(q_j, p_j)(x) = sum_x max(0, p_j - q_j)(x) = Z_j, after which
(induction, H_{j+1} holds the rejection) the row emits x with probability
p_{j+1}(x) = max(0, p_j - q_j)(x) / Z_j. In total min(q_j, p_j)(x) + max(0, p_j - q_j)(x)
= p_j(x). At j = 1, p_1 is the target's p: every row emits exactly the target's sample,
and by induction over the path so does every position after it. What the proof needs of
the drafter is only that q_j is the distribution sibling j was really drawn from given
its parent's path and the earlier siblings, which holds for siblings drawn independently
(q_j = q), without replacement (q_j = q without the earlier siblings, renormalised), or
chosen deterministically (q_j one-hot; distinct siblings, such as top-k tokens, waste no
draw since a rejected token's residual mass is zero). With one child per row it is the
chain rule exactly.
"""

from __future__ import annotations

from typing import Sequence as Seq

import torch

from servelab.sampler import draw, filtered_probs, greedy_tokens
from servelab.sampling_params import SamplingParams
from servelab.token_tree import children


def verify_tree_greedy(argmax: Seq[int], tokens: Seq[int], parents: Seq[int]) -> tuple[list[int], tuple[int, ...]]:
    """(emitted tokens, accepted node indices) for one sequence; argmax[r] is row r's."""
    kids = children(parents)
    path: list[int] = []
    row = 0
    while True:
        want = argmax[row]
        match = next((c for c in kids[row] if tokens[c] == want), None)
        if match is None:
            return [tokens[c] for c in path] + [want], tuple(path)
        path.append(match)
        row = match + 1


def verify_trees(logits: torch.Tensor, first_rows: Seq[int], tokens: Seq[Seq[int]], parents: Seq[Seq[int]],
                 probs: Seq[torch.Tensor | None], params: Seq[SamplingParams],
                 generators: Seq[torch.Generator | None]) -> list[tuple[list[int], tuple[int, ...]]]:
    """(emitted tokens, accepted node indices) per tree; tree t's rows are
    logits[first_rows[t]: first_rows[t] + len(tokens[t]) + 1]."""
    results: list[tuple[list[int], tuple[int, ...]] | None] = [None] * len(tokens)
    greedy = [t for t in range(len(tokens)) if params[t].is_greedy]
    if greedy:
        rows = [first_rows[t] + j for t in greedy for j in range(len(tokens[t]) + 1)]
        argmax = greedy_tokens(logits[torch.tensor(rows, dtype=torch.int64, device=logits.device)])
        start = 0
        for t in greedy:
            n = len(tokens[t]) + 1
            results[t] = verify_tree_greedy(argmax[start: start + n], tokens[t], parents[t])
            start += n
    sampled = [t for t in range(len(tokens)) if not params[t].is_greedy]
    if sampled:
        rows = [first_rows[t] + j for t in sampled for j in range(len(tokens[t]) + 1)]
        p = filtered_probs(logits[torch.tensor(rows, dtype=torch.int64, device=logits.device)],
                           [params[t] for t in sampled for _ in range(len(tokens[t]) + 1)])
        start = 0
        for t in sampled:
            n = len(tokens[t]) + 1
            results[t] = verify_tree_sampled(p[start: start + n], tokens[t], parents[t], probs[t], generators[t])
            start += n
    return results


def verify_tree_sampled(p_rows: torch.Tensor, tokens: Seq[int], parents: Seq[int], q: torch.Tensor | None,
                        generator: torch.Generator | None) -> tuple[list[int], tuple[int, ...]]:
    """Recursive rejection sampling over one tree (the module docstring's rule).
    p_rows [n + 1, vocab]: the target's filtered distributions; q [n, vocab] or None."""
    kids = children(parents)
    path: list[int] = []
    row = 0
    p = p_rows[0]
    uniform = torch.empty((), dtype=p.dtype, device=p.device)
    while True:
        for child in kids[row]:
            token = tokens[child]
            q_child = q[child].to(p.dtype) if q is not None else None
            q_token = q_child[token] if q_child is not None else 1.0
            # u < p / q, written without dividing: accept with probability min(1, p / q).
            if bool(uniform.uniform_(generator=generator) * q_token < p[token]):
                path.append(child)
                row = child + 1
                p = p_rows[row]
                break
            if q_child is None:
                residual = p.clone()
                residual[token] = 0.0
            else:
                residual = (p - q_child).clamp_(min=0)
            mass = residual.sum()
            if bool(mass > 0):  # zero only where p == q, which rejects with probability zero
                p = residual / mass
        else:
            final = int(draw(p[None], uniform.uniform_(generator=generator).view(1, 1))[0])
            return [tokens[c] for c in path] + [final], tuple(path)

"""Log-probabilities of chosen tokens and their top-k alternatives, from logits rows."""

from __future__ import annotations

from typing import Sequence as Seq

import torch

from servelab.outputs import Logprob, PositionLogprobs


def position_logprobs(logits: torch.Tensor, token_ids: Seq[int], num_top: Seq[int]) -> list[PositionLogprobs]:
    """Per row i: {token_ids[i]: its Logprob} plus the num_top[i] most likely tokens
    (as vLLM: the chosen token first, then the top-k, so k or k + 1 entries).

    `logits` [R, vocab], one row per chosen token; log-softmaxed here, in float32. A caller
    that processes its logits in place afterwards passes a copy of the rows."""
    if not token_ids:
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = torch.tensor(list(token_ids), dtype=torch.int64, device=logprobs.device)
    chosen_logprobs = logprobs.gather(1, chosen[:, None]).squeeze(1)
    # Rank 1 is the most likely; ties share the better rank.
    ranks = ((logprobs > chosen_logprobs[:, None]).sum(dim=1) + 1).tolist()
    chosen_values = chosen_logprobs.tolist()
    k = max(num_top)
    top_values, top_ids = (logprobs.topk(k, dim=1) if k else (None, None))
    top_values = top_values.tolist() if k else None
    top_ids = top_ids.tolist() if k else None
    result = []
    for i, token_id in enumerate(token_ids):
        position = {token_id: Logprob(chosen_values[i], ranks[i])}
        for j in range(num_top[i]):
            other = top_ids[i][j]
            if other not in position:
                position[other] = Logprob(top_values[i][j], j + 1)
        result.append(position)
    return result

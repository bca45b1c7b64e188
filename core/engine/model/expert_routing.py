"""Which experts a token goes to: the router's top-k, a documented seam (contract
`servelab.contracts.moe.ExpertRouting`, conformance `servelab.testing.moe`).

`standard`: softmax over the router's logits in float32, the k largest, divided by their
sum where the model normalises (Mixtral always, Qwen2-MoE never, Qwen3-MoE as its config
says). `grouped`: DeepSeek's group-limited top-k: the experts fall in `num_groups` equal
groups, a group scores its best expert, and a token picks its k among the experts of its
`topk_groups` best groups (so one token's experts sit on few devices under expert
parallelism). A checkpoint whose config names groups (`n_group`, `topk_group`) takes
`grouped`; the rest take `standard`.

`reference_top_k` is the plain per-token definition both are checked against.
"""

from __future__ import annotations

from typing import Callable

import torch

from servelab.contracts.moe import ROUTING_CONTRACT_VERSION


class StandardTopK:
    name = "standard"
    contract_version = ROUTING_CONTRACT_VERSION

    def select(self, logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, expert ids [T, k] int64), largest weight first."""
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, top_k, dim=-1)
        if normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids


class GroupedTopK:
    name = "grouped"
    contract_version = ROUTING_CONTRACT_VERSION

    def __init__(self, num_groups: int, topk_groups: int) -> None:
        if num_groups < 1 or not 1 <= topk_groups <= num_groups:
            raise ValueError(f"grouped top-k needs 1 <= topk_groups ({topk_groups}) <= num_groups ({num_groups})")
        self.num_groups, self.topk_groups = num_groups, topk_groups

    def select(self, logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, experts = logits.shape
        if experts % self.num_groups:
            raise ValueError(f"{experts} experts do not fall in {self.num_groups} equal groups")
        if top_k > experts // self.num_groups * self.topk_groups:
            raise ValueError(f"top_k={top_k} exceeds the experts of {self.topk_groups} groups of "
                             f"{experts // self.num_groups}")
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        group_scores = probs.view(tokens, self.num_groups, -1).amax(dim=-1)
        best_groups = torch.topk(group_scores, self.topk_groups, dim=-1).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
        expert_mask = group_mask.repeat_interleave(experts // self.num_groups, dim=1)
        weights, ids = torch.topk(probs.masked_fill(~expert_mask, -1.0), top_k, dim=-1)
        if normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids


ROUTING_POLICIES: dict[str, Callable[..., object]] = {
    "standard": lambda num_groups=1, topk_groups=1: StandardTopK(),
    "grouped": lambda num_groups=1, topk_groups=1: GroupedTopK(num_groups, topk_groups),
}


def routing_policy(name: str, num_groups: int = 1, topk_groups: int = 1):
    if name not in ROUTING_POLICIES:
        raise ValueError(f"unknown expert routing {name!r}; known: {', '.join(ROUTING_POLICIES)}")
    return ROUTING_POLICIES[name](num_groups=num_groups, topk_groups=topk_groups)


def reference_top_k(logits: torch.Tensor, top_k: int, normalize: bool, num_groups: int = 1,
                    topk_groups: int = 1) -> tuple[list[list[float]], list[list[int]]]:
    """The definition, one token at a time in plain Python: per token, the chosen experts
    (largest probability first) and their weights."""
    all_weights, all_ids = [], []
    for row in logits.float().tolist():
        peak = max(row)
        exps = [pow(2.718281828459045, v - peak) for v in row]
        probs = [e / sum(exps) for e in exps]
        size = len(row) // num_groups
        groups = sorted(range(num_groups), key=lambda g: -max(probs[g * size:(g + 1) * size]))[:topk_groups]
        allowed = [e for g in groups for e in range(g * size, (g + 1) * size)]
        chosen = sorted(allowed, key=lambda e: -probs[e])[:top_k]
        weights = [probs[e] for e in chosen]
        if normalize:
            weights = [w / sum(weights) for w in weights]
        all_weights.append(weights)
        all_ids.append(chosen)
    return all_weights, all_ids

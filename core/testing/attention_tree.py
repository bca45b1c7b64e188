"""Token-tree batches for the attention contract, checked against masked attention in
plain torch (an explicit mask and a softmax).

A batch mixes sequences verifying a random token tree (a root row and its nodes, with
`AttentionMetadata.tree_parents`) with plain decodes and chunks. Each sequence's cached
prefix is written first by an ordinary step; then the tree step writes every query row's
K/V at the slots after the prefix, in row order, and row r must attend to the prefix and
to the rows on its own root path only (servelab.token_tree.ancestor_mask).
"""

from __future__ import annotations

import math
import random
from typing import Any

import torch

from servelab.interfaces import AttentionContext
from servelab.testing.attention_batch import TOLERANCE, metadata_for
from servelab.testing.contract import check
from servelab.token_tree import ancestor_mask, query_parents

TREE = "token-tree rows attend to the context and their own root path (explicit-mask reference)"


def masked_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """q [Q, h, d] over k / v [C, kvh, d] where visible [Q, C] (bool), GQA by repetition,
    in float32: softmax(q k^T * scale, masked to -inf where hidden) v."""
    q, k, v = q.float(), k.float(), v.float()
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,chd->hqc", q, k) * scale
    scores = scores.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hqc,chd->qhd", torch.softmax(scores, dim=-1), v)


def random_parents(rng: random.Random, num_nodes: int) -> list[int]:
    """A random tree over `num_nodes` nodes listed parents first (never a chain when it can branch)."""
    while True:
        parents = [rng.randint(-1, i - 1) for i in range(num_nodes)]
        if num_nodes < 2 or any(p != i - 1 for i, p in enumerate(parents)):
            return parents


class TreeBatchCheck:
    def __init__(self, make_backend: Any, *, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 dtype: torch.dtype, device: Any, seed: int, num_seqs: int = 5) -> None:
        rng = random.Random(seed)
        self.generator = torch.Generator().manual_seed(seed)
        self.dtype, self.device, self.block_size = dtype, torch.device(device), block_size
        self.scale = head_dim ** -0.5
        # (cached prefix, query rows, query-row parents or None)
        self.seqs: list[tuple[int, int, tuple[int, ...] | None]] = []
        for index in range(num_seqs):
            prefix = rng.randint(1, 40)
            kind = rng.choice(["tree", "tree", "decode", "chunk"]) if index else "tree"
            if kind == "tree":
                nodes = rng.randint(2, 12)
                self.seqs.append((prefix, nodes + 1, query_parents(random_parents(rng, nodes))))
            else:
                self.seqs.append((prefix, 1 if kind == "decode" else rng.randint(2, 6), None))
        lengths = [math.ceil((c + n) / block_size) for c, n, _ in self.seqs]
        num_blocks = sum(lengths) + 3
        self.backend = make_backend(AttentionContext(
            num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
            num_blocks=num_blocks, dtype=dtype, device=self.device))
        shape = tuple(self.backend.kv_cache_shape())
        self.key_cache = self._randn(shape).mul_(4)  # noise: reading an unwritten slot shows
        self.value_cache = self._randn(shape).mul_(4)
        physical = torch.randperm(num_blocks, generator=self.generator).tolist()
        self.tables = [[physical.pop() for _ in range(length)] for length in lengths]
        self.keys = [self._randn((c + n, num_kv_heads, head_dim)) for c, n, _ in self.seqs]
        self.values = [self._randn((c + n, num_kv_heads, head_dim)) for c, n, _ in self.seqs]
        self.queries = [self._randn((c + n, num_heads, head_dim)) for c, n, _ in self.seqs]

    def _randn(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randn(shape, generator=self.generator).to(self.dtype).to(self.device)

    def _forward(self, spans: list[tuple[int, int]], trees: tuple | None) -> torch.Tensor:
        metadata = metadata_for(self.tables, [e - s for s, e in spans], [e for _, e in spans], self.block_size,
                                self.device)
        if trees is not None:
            import attrs

            metadata = attrs.evolve(metadata, tree_parents=trees)
        cat = torch.cat
        query = cat([q[s:e] for q, (s, e) in zip(self.queries, spans)])
        key = cat([k[s:e] for k, (s, e) in zip(self.keys, spans)])
        value = cat([v[s:e] for v, (s, e) in zip(self.values, spans)])
        return self.backend.forward(query, key, value, self.key_cache, self.value_cache,
                                    self.backend.prepare(metadata), self.scale)

    def run(self) -> None:
        self._forward([(0, c) for c, _, _ in self.seqs], None)  # the cached prefixes, as a prefill
        out = self._forward([(c, c + n) for c, n, _ in self.seqs], tuple(t for _, _, t in self.seqs))
        tolerance = TOLERANCE[self.dtype]
        start = 0
        for i, (prefix, rows, tree) in enumerate(self.seqs):
            visible = torch.zeros(rows, prefix + rows, dtype=torch.bool)
            visible[:, :prefix] = True
            if tree is None:
                visible[:, prefix:] = torch.ones(rows, rows, dtype=torch.bool).tril()
            else:
                visible[:, prefix:] = torch.from_numpy(ancestor_mask(tree))
            expected = masked_reference(self.queries[i][prefix:], self.keys[i], self.values[i], visible, self.scale)
            got = out[start: start + rows].float().cpu()
            error = (got - expected).abs().max().item()
            check(torch.allclose(got, expected, rtol=tolerance, atol=tolerance), TREE, lambda: (
                f"sequence {i} (prefix {prefix}, {rows} rows, tree {tree}): max abs error {error:.3g} > "
                f"{tolerance:g}"))
            start += rows


__all__ = ["TreeBatchCheck", "masked_reference", "random_parents"]

"""The static token tree Medusa drafts (Cai et al. 2024, "sparse tree"), chosen from the
heads' measured accuracies.

A node is a path of ranks (r_1, ..., r_d): its token is head d's r_d-th most likely
token, its parent the path (r_1, ..., r_{d-1}). Medusa-1 heads all read the same hidden
state, so head d's candidates do not depend on the path above them and the tree's shape
is fixed; only its tokens change per step.

`accuracy[h][r]` is how often head h's rank-r token is the target's token (measured on
the target's own greedy outputs, `medusa_accuracy.json`). Assuming the levels agree
independently, node (r_1..r_d) is accepted with probability prod_j accuracy[j - 1][r_j],
and greedy verification accepts at most one node per level, so the expected number of
accepted tokens is the sum of the nodes' probabilities. The best tree of N nodes takes
the N most probable nodes, grown best first from the root's children; a child is never
more probable than its parent, so the set is closed under parents (a tree).
"""

from __future__ import annotations

import heapq
import json
from pathlib import Path
from typing import Sequence as Seq

import attrs

from servelab.errors import ConfigError

ACCURACY_FILE = "medusa_accuracy.json"
MEASURE_COMMAND = "python examples/measurements/medusa_accuracy.py"


@attrs.frozen
class TreeShape:
    """Nodes listed parents first: each node's head (its depth - 1), rank and parent."""

    heads: tuple[int, ...]
    ranks: tuple[int, ...]
    parents: tuple[int, ...]
    expected_accepted: float  # sum of the nodes' acceptance probabilities under the model above

    @property
    def paths(self) -> list[tuple[int, ...]]:
        out: list[tuple[int, ...]] = []
        for rank, parent in zip(self.ranks, self.parents):
            out.append((out[parent] if parent >= 0 else ()) + (rank,))
        return out


def best_tree(accuracy: Seq[Seq[float]], num_nodes: int) -> TreeShape:
    """The `num_nodes` most probable nodes (ties: the shorter, then lexicographically
    smaller path), over as many levels as `accuracy` has heads."""
    heap: list[tuple[float, tuple[int, ...]]] = [(-float(accuracy[0][r]), (r,)) for r in range(len(accuracy[0]))]
    heapq.heapify(heap)
    chosen: list[tuple[float, tuple[int, ...]]] = []
    while heap and len(chosen) < num_nodes:
        negative, path = heapq.heappop(heap)
        chosen.append((-negative, path))
        if len(path) < len(accuracy):
            for rank, p in enumerate(accuracy[len(path)]):
                heapq.heappush(heap, (negative * float(p), path + (rank,)))
    ordered = sorted(chosen, key=lambda item: (len(item[1]), item[1]))  # parents first
    index = {path: i for i, (_, path) in enumerate(ordered)}
    return TreeShape(heads=tuple(len(path) - 1 for _, path in ordered), ranks=tuple(path[-1] for _, path in ordered),
                     parents=tuple(index[path[:-1]] if len(path) > 1 else -1 for _, path in ordered),
                     expected_accepted=sum(p for p, _ in ordered))


def load_accuracy(directory: Path, num_heads: int, top_k: int) -> list[list[float]]:
    """Per head, the accuracy of its rank 0 .. top_k - 1 tokens, from ACCURACY_FILE."""
    path = directory / ACCURACY_FILE
    if not path.is_file():
        raise ConfigError(f"drafter 'medusa': tree_nodes > 0 chooses the tree from the heads' measured "
                          f"accuracies, and {str(path)!r} does not exist; measure them with `{MEASURE_COMMAND}` "
                          f"or set tree_nodes = 0 (the top-1 chain)")
    table = json.loads(path.read_text())["top_k_accuracy"]
    if len(table) < num_heads:
        raise ConfigError(f"drafter 'medusa': {str(path)!r} measures {len(table)} heads, {num_heads} are used")
    return [list(map(float, row[:top_k])) for row in table[:num_heads]]

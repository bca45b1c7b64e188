"""Token trees: the shape speculative drafts take (servelab.interfaces.Draft.parents).

A tree of n draft nodes is its tokens and one parent index per node: `parents[i]` is -1
for a child of the root (the sequence's last verified token) or the index of an earlier
node (`parents[i] < i`), so nodes are listed parents first and any prefix of the list is
a tree too (the engine cuts a tree by keeping a prefix). A chain is the one-branch tree,
parents (-1, 0, 1, ..., n - 2); a draft without parents is a chain.

In a step, a sequence with a tree has one query row for its last verified token (row 0,
the root) and one per node (row i + 1 for node i). Row r attends to the cached context
and to the rows on its own root path (itself and its ancestors): the tree mask.
Node i sits at position base + depth(i), base being the root's position, and its K/V in
the slot of logical position base + 1 + i; verification keeps one root path, whose K/V
the engine moves into the slots base + 1, base + 2, ... before rolling the rest back.

Torch-free (numpy only where a mask is built): servelab.interfaces re-exports it for plugins.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence as Seq

if TYPE_CHECKING:
    import numpy as np


def tree_error(parents: Seq[int], num_tokens: int) -> str | None:
    """Why `parents` is not a tree over `num_tokens` nodes listed parents first, or None."""
    if len(parents) != num_tokens:
        return f"{len(parents)} parents for {num_tokens} tokens"
    for i, parent in enumerate(parents):
        if isinstance(parent, bool) or not isinstance(parent, int) or not -1 <= parent < i:
            return f"parents[{i}] = {parent!r}: must be -1 (a child of the root) or an earlier node's index"
    return None


def is_chain(parents: Seq[int] | None) -> bool:
    return parents is None or all(parent == i - 1 for i, parent in enumerate(parents))


def depths(parents: Seq[int]) -> list[int]:
    """Depth of each node: 1 for a child of the root."""
    out: list[int] = []
    for parent in parents:
        out.append(1 if parent < 0 else out[parent] + 1)
    return out


def max_depth(parents: Seq[int] | None, num_tokens: int) -> int:
    """The longest root path: the most drafts the tree can have accepted."""
    if parents is None:
        return num_tokens
    return max(depths(parents), default=0)


def first_branch(parents: Seq[int]) -> list[int]:
    """Node indices of the tree's first branch (the first child at every level): the
    chain a chain-only consumer verifies instead of the tree."""
    path: list[int] = []
    node = -1
    for i, parent in enumerate(parents):
        if parent == node:
            path.append(i)
            node = i
    return path


def children(parents: Seq[int]) -> list[list[int]]:
    """children[r]: the node indices whose parent is row r - 1 (r = 0: the root), in order."""
    out: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, parent in enumerate(parents):
        out[parent + 1].append(i)
    return out


def query_parents(parents: Seq[int]) -> tuple[int, ...]:
    """The tree over a sequence's query rows: row 0 (the root) has parent -1, row i + 1
    (node i) has parent row parents[i] + 1."""
    return (-1,) + tuple(parent + 1 for parent in parents)


def row_depths(row_parents: Seq[int]) -> "np.ndarray":
    """Depth of each query row below row 0 (row 0: 0)."""
    import numpy as np

    out = np.zeros(len(row_parents), dtype=np.int64)
    for row, parent in enumerate(row_parents):
        if parent >= 0:
            out[row] = out[parent] + 1
    return out


def ancestor_mask(row_parents: Seq[int]) -> "np.ndarray":
    """[Q, Q] bool: mask[r, c] when row c is row r or one of its ancestors."""
    import numpy as np

    num_rows = len(row_parents)
    mask = np.zeros((num_rows, num_rows), dtype=bool)
    for row, parent in enumerate(row_parents):
        if parent >= 0:
            mask[row] = mask[parent]
        mask[row, row] = True
    return mask

"""A suffix trie of bounded depth with occurrence counts: the data structure behind the
`suffix` drafter (suffix decoding, Oliaro et al. 2024, as Arctic Inference and vLLM
ship it).

Every substring of at most `depth` tokens of the streams inserted is a node; a node's
`count` is how often its substring occurs, `continued` how often an occurrence is
followed by another token (the sum of its children's counts), and `best` its most
frequent child (ties: the one seen most recently). The trie keeps the whole branching
of what followed each context, so a drafter can walk one chain today (the most
frequent child at each step) and expand a tree of candidates later from the same
nodes.

Appending a token to a stream costs O(depth): the stream's `Cursor` holds the nodes of
its suffixes of length 0 .. depth - 1, and each gains the token as a child. A stream
can also be removed (its counts taken back, empty nodes deleted), which is how a
bounded cache evicts.
"""

from __future__ import annotations

import heapq
import itertools

from typing import Iterable, Sequence as Seq

import attrs


class Node:
    __slots__ = ("token", "depth", "count", "continued", "last", "children", "best")

    def __init__(self, token: int, depth: int) -> None:
        self.token = token
        self.depth = depth
        self.count = 0  # occurrences of this node's substring
        self.continued = 0  # occurrences followed by a token: the children's counts summed
        self.last = -1  # stamp of the latest occurrence (ties between siblings go to the latest)
        self.children: dict[int, Node] | None = None
        self.best: Node | None = None  # the child with the highest (count, last)

    def child(self, token: int) -> "Node | None":
        return self.children.get(token) if self.children is not None else None

    def _rescan(self) -> None:
        self.best = max(self.children.values(), key=lambda c: (c.count, c.last)) if self.children else None


@attrs.define
class Cursor:
    """Where a stream stands in a trie: `nodes[m]` is the node of its last m tokens
    (m = 0 is the root), for every m the trie holds, up to depth - 1."""

    nodes: list[Node]


@attrs.frozen
class Chain:
    """A proposal walked down the trie: tokens, the probability of each prefix under the
    trie's counts, their sum (the expected number of tokens accepted) and the length of
    the context it was matched on."""

    token_ids: tuple[int, ...] = ()
    probs: tuple[float, ...] = ()
    match_len: int = 0

    @property
    def score(self) -> float:
        return sum(self.probs)


class SuffixTrie:
    def __init__(self, depth: int) -> None:
        if depth < 2:
            raise ValueError(f"a suffix trie needs depth >= 2, got {depth}")
        self.depth = depth
        self.root = Node(-1, 0)
        self.num_nodes = 1
        self.stamp = 0  # one per token inserted: orders occurrences for tie-breaking

    def cursor(self) -> Cursor:
        return Cursor([self.root])

    # ------------------------------------------------------------ building

    def append(self, cursor: Cursor, token: int) -> None:
        """Append `token` to the stream at `cursor`: every suffix ending there gains it."""
        self.stamp += 1
        stamp, limit, new_node = self.stamp, self.depth - 1, Node
        moved = [self.root]
        keep = moved.append
        created = 0
        for node in cursor.nodes:
            children = node.children
            if children is None:
                child = None
                children = node.children = {}
            else:
                child = children.get(token)
            if child is None:
                child = children[token] = new_node(token, node.depth + 1)
                created += 1
            count = child.count = child.count + 1
            child.last = stamp
            node.continued += 1
            best = node.best
            if best is None or count >= best.count:
                node.best = child
            if child.depth <= limit:
                keep(child)
        self.num_nodes += created
        cursor.nodes = moved

    def extend(self, cursor: Cursor, tokens: Iterable[int]) -> None:
        for token in tokens:
            self.append(cursor, token)

    def remove(self, tokens: Seq[int]) -> None:
        """Take back one earlier insertion of the stream `tokens` (whole): every substring
        of at most `depth` tokens loses an occurrence; nodes left with none are deleted."""
        for start in range(len(tokens)):
            node = self.root
            for token in tokens[start: start + self.depth]:
                child = node.child(token)
                if child is None:
                    raise ValueError("removing a stream that was never inserted")
                child.count -= 1
                node.continued -= 1
                if child.count == 0:
                    del node.children[token]
                    self.num_nodes -= self._size(child)
                    node._rescan()
                    break
                if node.best is child:
                    node._rescan()
                node = child

    def _size(self, node: Node) -> int:
        return 1 + sum(self._size(c) for c in node.children.values()) if node.children else 1

    # ------------------------------------------------------------ reading

    def follow(self, cursor: Cursor, tokens: Iterable[int]) -> None:
        """Move `cursor` over `tokens` without inserting: it keeps the suffixes the trie
        holds (for matching a stream against a trie it is not part of)."""
        limit = self.depth - 1
        for token in tokens:
            moved = [self.root]
            for node in cursor.nodes:
                child = node.child(token)
                if child is None:
                    break  # the trie is closed under substrings: no longer suffix is held either
                if child.depth <= limit:
                    moved.append(child)
            cursor.nodes = moved

    def match(self, cursor: Cursor, max_len: int) -> Node | None:
        """The longest suffix at `cursor`, of at most max_len tokens, whose substring was
        followed by something; None if even the last token never was."""
        nodes = cursor.nodes
        for m in range(min(max_len, len(nodes) - 1), 0, -1):
            if nodes[m].continued:
                return nodes[m]
        return None

    def tree(self, node: Node, max_depth: int, max_nodes: int, min_prob: float) -> tuple[list[int], list[int]]:
        """From `node`, the `max_nodes` most probable continuations as a token tree (tokens,
        parents listed first): best first by the product of count / continued along each
        path, at most max_depth deep, none below min_prob. A child is never more probable
        than its parent, so every node's parent is taken before it."""
        tokens: list[int] = []
        parents: list[int] = []
        order = itertools.count()
        heap: list[tuple[float, int, Node, int, int]] = []

        def push(parent: Node, prob: float, index: int, depth: int) -> None:
            if parent.children is None or depth > max_depth:
                return
            for child in heapq.nlargest(max_nodes, parent.children.values(), key=lambda c: (c.count, c.last)):
                heapq.heappush(heap, (-prob * child.count / parent.continued, next(order), child, index, depth))

        push(node, 1.0, -1, 1)
        while heap and len(tokens) < max_nodes:
            negative, _, child, parent, depth = heapq.heappop(heap)
            if -negative < min_prob:
                break
            parents.append(parent)
            tokens.append(child.token)
            push(child, -negative, len(tokens) - 1, depth + 1)
        return tokens, parents

    def walk(self, node: Node, max_tokens: int, min_prob: float) -> Chain:
        """From `node`, the most frequent child at each step while the chain's probability
        (the product of count / continued along it) stays at least min_prob."""
        tokens, probs, prob = [], [], 1.0
        while len(tokens) < max_tokens and node.best is not None:
            child = node.best
            prob *= child.count / node.continued
            if prob < min_prob:
                break
            tokens.append(child.token)
            probs.append(prob)
            node = child
        return Chain(tuple(tokens), tuple(probs), 0)

"""A radix tree from token prefixes to the KV blocks that hold them.

Pure bookkeeping: it maps chunks of `block_size` tokens to block ids and knows
nothing of tensors or reference counts, so it builds and prints on its own:

    >>> tree = RadixTree()
    >>> tree.insert(None, (1, 2), 10), tree.insert(10, (3, 4), 11), tree.insert(10, (5, 6), 12)
    (10, 11, 12)
    >>> print(tree)
    RadixTree: 3 blocks, 3 nodes
    └── [10] 1 2  (used 1)
        ├── [11] 3 4  (used 2)
        └── [12] 5 6  (used 3)

Each edge holds a run of chunks (one per block); a run splits where two prefixes part,
so a node's blocks are always a unit of shared history. The path from the root to a
block spells the whole prefix whose last chunk the block holds: a hit is confirmed
token by token, never trusted to a hash alone.

It is the `radix` allocator's `servelab.kit.PrefixIndex`: eviction candidates are the
leaves (the evictable tail of each leaf's run, named by its last block), so a prefix is
never evicted before its extensions; the eviction policy orders them. A node counts as
used when a lookup passes through it, a block is inserted into it, or `touch` is called
on one of its blocks; it counts a hit for every lookup through it. `evict(count,
can_evict)` evicts least recently used leaves first (ties: the older node), each from
its last block, as the default policy does.
"""

from __future__ import annotations

import itertools
from typing import Callable, Iterable

from servelab.interfaces import ROOT_BLOCK_HASH, EvictionCandidate, chained_block_hash
from servelab.kit import LeastRecentlyUsed

Chunk = tuple[int, ...]


class _Node:
    __slots__ = ("key", "chunks", "blocks", "parent", "children", "last_used", "node_id", "hits", "depth")

    def __init__(self, chunks: list[Chunk], blocks: list[int], parent: "_Node | None", last_used: int,
                 node_id: int, hits: int = 0) -> None:
        self.key = chunks[0] if chunks else None  # the first chunk: this node's edge label in parent.children
        self.chunks = chunks
        self.blocks = blocks
        self.parent = parent
        self.children: dict[Chunk, _Node] = {}
        self.last_used = last_used
        self.node_id = node_id
        self.hits = hits  # lookups that passed through it
        # Blocks from the root to this node's first block, minus one.
        self.depth = parent.depth + len(parent.blocks) if parent is not None else 0

    def eviction_key(self) -> tuple[int, int]:
        """Least recently used first; among equals, the older node."""
        return (self.last_used, self.node_id)


class RadixTree:
    """Chunk sequences -> block ids, with LRU leaf-first eviction."""

    def __init__(self) -> None:
        self._ids = itertools.count()
        self.root = _Node([], [], None, 0, next(self._ids))
        self._node_of: dict[int, _Node] = {}  # block id -> node holding it
        # block id -> chained hash of the prefix it ends (`chained_block_hash`), for routers
        self._hash_of: dict[int, int] = {}
        self._hashes: frozenset[int] | None = frozenset()  # their values, until the tree changes
        self._clock = 0
        self._changed: Callable[[int], None] | None = None  # the cache's EvictionQueue, when it keeps one

    def __len__(self) -> int:
        """Blocks in the tree."""
        return len(self._node_of)

    def __contains__(self, block: int) -> bool:
        return block in self._node_of

    def match(self, chunks: Iterable[Chunk]) -> list[int]:
        """Blocks holding the longest cached prefix of `chunks`; marks that path used."""
        return self._walk(chunks, self._tick())

    def peek(self, chunks: Iterable[Chunk]) -> list[int]:
        """The blocks `match` would return, changing nothing."""
        return self._walk(chunks, None)

    def _walk(self, chunks: Iterable[Chunk], now: int | None) -> list[int]:
        node, position = self.root, 0
        blocks: list[int] = []
        for chunk in chunks:
            if position == len(node.chunks):
                child = node.children.get(chunk)
                if child is None:
                    break
                node, position = child, 0
                if now is not None:
                    node.hits += 1
            elif node.chunks[position] != chunk:
                break
            blocks.append(node.blocks[position])
            position += 1
            if now is not None:
                node.last_used = now
        if now is not None:
            self._leaf_changed(node)
        return blocks

    def insert(self, parent_block: int | None, chunk: Chunk, block: int) -> int:
        """Cache `block` as holding `chunk` right after `parent_block` (None: at the root).

        Returns the block now cached for that prefix: `block`, or the block that already
        held the same chunk there (then `block` is not cached).
        """
        now = self._tick()
        if parent_block is None:
            node, position = self.root, 0
        else:
            node = self._node_of[parent_block]
            position = node.blocks.index(parent_block) + 1
        if position < len(node.chunks):
            if node.chunks[position] == chunk:
                self._touch_path(node, now)
                return node.blocks[position]
            self._split(node, position)
        self._touch_path(node, now)
        child = node.children.get(chunk)
        if child is not None:
            child.last_used = now
            self._leaf_changed(child)
            return child.blocks[0]
        if block in self._node_of:
            raise ValueError(f"block {block} is already cached for another prefix")
        if node is not self.root and not node.children:
            node.chunks.append(chunk)  # extend a leaf's run in place
            node.blocks.append(block)
        else:
            node = self._add_child(node, [chunk], [block], now)
        self._node_of[block] = node
        parent_hash = ROOT_BLOCK_HASH if parent_block is None else self._hash_of[parent_block]
        self._hash_of[block] = chained_block_hash(parent_hash, chunk)
        self._hashes = None
        return block

    def touch(self, block: int) -> None:
        """Mark the prefix ending at `block` as just used."""
        self._touch_path(self._node_of[block], self._tick())

    def held(self, block: int) -> None:
        """A held block leaves its leaf's evictable tail: the tail's candidate changed."""
        node = self._node_of[block]
        if not node.children:
            self._leaf_changed(node)

    def unheld(self, block: int) -> None:
        """The leaf holding `block` may have become (more) evictable."""
        self._leaf_changed(self._node_of[block])

    def candidates(self, can_evict: Callable[[int], bool]) -> list[EvictionCandidate]:
        """The evictable tail of every leaf whose last block `can_evict`, named by that block."""
        found = (self._candidate(leaf, can_evict) for leaf in self._leaves())
        return [candidate for candidate in found if candidate is not None]

    def watch(self, changed: Callable[[int], None], can_evict: Callable[[int], bool]) -> None:
        """Report leaves' changes to `changed` (`servelab.kit.IncrementalPrefixIndex`)."""
        self._changed = changed

    def candidate(self, block: int, can_evict: Callable[[int], bool]) -> EvictionCandidate | None:
        node = self._node_of.get(block)
        if node is None or node.children or node.blocks[-1] != block:
            return None
        return self._candidate(node, can_evict)

    @staticmethod
    def _candidate(leaf: _Node, can_evict: Callable[[int], bool]) -> EvictionCandidate | None:
        blocks = leaf.blocks
        if not can_evict(blocks[-1]):
            return None
        size = 1
        while size < len(blocks) and can_evict(blocks[-size - 1]):
            size += 1
        return EvictionCandidate(block=blocks[-1], last_access=leaf.last_used, inserted=leaf.node_id,
                                 hits=leaf.hits, depth=leaf.depth + len(blocks), size=size)

    def blocks_of(self, block: int, size: int) -> list[int]:
        return self._node_of[block].blocks[-size:]

    def drop(self, block: int, max_blocks: int, can_evict: Callable[[int], bool]) -> tuple[list[int], bool]:
        """Remove up to `max_blocks` blocks of the leaf ending at `block`, from its last;
        True when that emptied the leaf and made its parent an evictable leaf."""
        node = self._node_of[block]
        evicted: list[int] = []
        while node.blocks and len(evicted) < max_blocks and can_evict(node.blocks[-1]):
            node.chunks.pop()
            removed = node.blocks.pop()
            del self._node_of[removed]
            del self._hash_of[removed]
            evicted.append(removed)
        self._hashes = None
        if node.blocks:
            self._leaf_changed(node)  # its tail is named by its new last block
            return evicted, False
        parent = node.parent
        del parent.children[node.key]
        self._leaf_changed(parent)
        return evicted, parent is not self.root and not parent.children and can_evict(parent.blocks[-1])

    def evict(self, count: int, can_evict: Callable[[int], bool]) -> list[int]:
        """Remove up to `count` blocks for which `can_evict` holds, least recently used
        leaves first, each leaf from its last block; returns them in eviction order."""
        policy = LeastRecentlyUsed()
        evicted: list[int] = []
        while len(evicted) < count:
            candidates = self.candidates(can_evict)
            if not candidates:
                break
            changed = False
            for chosen in policy.choose(candidates, count - len(evicted)):
                blocks, changed = self.drop(chosen, count - len(evicted), can_evict)
                evicted.extend(blocks)
                if changed or len(evicted) >= count:
                    break
            if not changed:
                break
        return evicted

    def format(self, max_tokens: int = 8) -> str:
        """The tree, one node per line: its blocks, the first tokens of its run, last use."""
        num_nodes = sum(1 for _ in self._nodes()) - 1
        lines = [f"RadixTree: {len(self)} blocks, {num_nodes} nodes"]
        self._format_children(self.root, "", lines, max_tokens)
        return "\n".join(lines)

    __str__ = format

    # ------------------------------------------------------------ internals

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _leaf_changed(self, node: _Node) -> None:
        if self._changed is not None and node is not self.root and not node.children and node.blocks:
            self._changed(node.blocks[-1])

    def _touch_path(self, node: _Node, now: int) -> None:
        start = node
        while node is not None and node is not self.root:
            node.last_used = now
            node = node.parent
        self._leaf_changed(start)  # only the first can be a leaf

    def _add_child(self, parent: _Node, chunks: list[Chunk], blocks: list[int], now: int) -> _Node:
        child = _Node(chunks, blocks, parent, now, next(self._ids))
        parent.children[child.key] = child
        return child

    def _split(self, node: _Node, position: int) -> None:
        """Cut `node`'s run before `position`; the tail becomes its only child."""
        tail = _Node(node.chunks[position:], node.blocks[position:], node, node.last_used, next(self._ids),
                     node.hits)
        tail.depth = node.depth + position
        tail.children = node.children
        for child in tail.children.values():
            child.parent = tail
        for block in tail.blocks:
            self._node_of[block] = tail
        del node.chunks[position:]
        del node.blocks[position:]
        node.children = {tail.key: tail}
        self._leaf_changed(tail)  # a leaf's tail keeps its name but is a new node

    def block_hashes(self) -> frozenset[int]:
        """The chained hash (`chained_block_hash`) of every cached block: the names a
        `PrefixSummary` gives the prefixes the tree holds. Kept as blocks enter and
        leave, so a router reading it at every arrival costs no walk of the tree."""
        if self._hashes is None:
            self._hashes = frozenset(self._hash_of.values())
        return self._hashes

    def _nodes(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _leaves(self):
        return (node for node in self._nodes() if not node.children and node is not self.root)

    def _format_children(self, node: _Node, indent: str, lines: list[str], max_tokens: int) -> None:
        children = sorted(node.children.values(), key=lambda n: n.node_id)
        for i, child in enumerate(children):
            last = i == len(children) - 1
            tokens = [t for chunk in child.chunks for t in chunk]
            shown = " ".join(map(str, tokens[:max_tokens])) + (" ..." if len(tokens) > max_tokens else "")
            blocks = ",".join(map(str, child.blocks))
            lines.append(f"{indent}{'└── ' if last else '├── '}[{blocks}] {shown}  (used {child.last_used})")
            self._format_children(child, indent + ("    " if last else "│   "), lines, max_tokens)

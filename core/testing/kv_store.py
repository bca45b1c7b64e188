"""A simulated KV cache for allocator contracts: where a runner would store a token's K/V
it stores a value that, like real K/V, depends on the token's position and on every
token before it (a hash chained through the prefix). A sequence reading the wrong slot
reads the wrong value, and so does one reusing a block whose tokens match its own but
whose earlier context does not ("Y0 X1" must not reuse block 1 of "X0 X1").

It does what the engine and runner do around an allocator: perform the queued block
copies first, then write each sequence's new tokens into the slots its block table
names, then let a prefix-caching allocator cache the computed blocks.
"""

from __future__ import annotations

from typing import Any

from servelab.interfaces import ForkingAllocator, PrefixCachingAllocator, Sequence
from servelab.sampling_params import SamplingParams
from servelab.testing.contract import check

COPY_ON_WRITE = "copy-on-write (every sequence reads back exactly its own tokens)"
PREFIX_HIT_TOKENS = "a prefix-cache hit holds the K/V of the whole matched prefix"
TABLE_COVERS_TOKENS = "the block table covers exactly the allocated tokens"


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def kv_values(tokens: list[int]) -> list[int]:
    """The simulated K/V of each position of `tokens`: a hash of the position and of
    every token up to it, so equal tokens after different prefixes differ."""
    values, chain = [], 0
    for position, token in enumerate(tokens):
        chain = hash((chain, position, token))
        values.append(chain)
    return values


def new_sequence(seq_id: str, tokens: list[int], num_computed: int = 0) -> Sequence:
    seq = Sequence(seq_id, list(tokens), SamplingParams(), 0.0)
    seq.num_computed_tokens = num_computed
    return seq


class KVStore:
    """`num_blocks` x `block_size` slots of simulated K/V values (None: never written)."""

    def __init__(self, allocator: Any, num_blocks: int, block_size: int) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.slots: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.forking = isinstance(allocator, ForkingAllocator)
        self.caching = isinstance(allocator, PrefixCachingAllocator)

    def step(self, seqs: list[Sequence]) -> None:
        """One engine step: block copies in order, then every uncomputed token into its slot."""
        if self.forking:
            for source, destination in self.allocator.take_block_copies():
                check(0 <= source < self.num_blocks and 0 <= destination < self.num_blocks,
                      "block ids are valid", f"block copy ({source}, {destination}) outside [0, {self.num_blocks})")
                self.slots[destination] = list(self.slots[source])
        for seq in seqs:
            table = self.table(seq)
            values = kv_values(seq.prompt_token_ids[: seq.num_tokens])
            for position in range(seq.num_computed_tokens, seq.num_tokens):
                block, offset = divmod(position, self.block_size)
                self.slots[table[block]][offset] = values[position]
            seq.num_computed_tokens = seq.num_tokens
            if self.caching:
                self.allocator.cache_blocks(seq)
        for seq in seqs:
            self.check_reads_own_tokens(seq)

    def table(self, seq: Sequence, num_tokens: int | None = None) -> list[int]:
        """`seq`'s block table, checked to cover its first `num_tokens` (default: all) tokens."""
        table = list(self.allocator.block_table(seq.request_id))
        num_tokens = seq.num_tokens if num_tokens is None else num_tokens
        check(len(table) >= blocks_for(num_tokens, self.block_size), TABLE_COVERS_TOKENS,
              lambda: f"{seq.request_id} holds {num_tokens} tokens in {len(table)} blocks of {self.block_size}")
        check(all(0 <= b < self.num_blocks for b in table), "block ids are valid",
              lambda: f"{seq.request_id}'s table {table} has ids outside [0, {self.num_blocks})")
        return table

    def visible(self, seq: Sequence, end: int | None = None) -> list[int | None]:
        """What `seq` reads through its block table for positions [0, end)."""
        end = seq.num_tokens if end is None else end
        table = self.table(seq, end)
        return [self.slots[table[i // self.block_size]][i % self.block_size] for i in range(end)]

    def check_reads_own_tokens(self, seq: Sequence) -> None:
        seen = self.visible(seq)
        expected = kv_values(seq.prompt_token_ids[: seq.num_tokens])
        wrong = [i for i, (a, b) in enumerate(zip(seen, expected)) if a != b]
        check(seen == expected, COPY_ON_WRITE, lambda: (
            f"{seq.request_id} (tokens {seq.prompt_token_ids[: seq.num_tokens]}) reads other K/V than it wrote "
            f"at positions {wrong} through its block table "
            f"{list(self.allocator.block_table(seq.request_id))}: another sequence wrote into a block it "
            f"shares (copy the block first), or a block was handed out twice"))

    def check_prefix_hit(self, seq: Sequence, hit: int) -> None:
        seen = self.visible(seq, hit)
        wrong = [i for i, (a, b) in enumerate(zip(seen, kv_values(seq.prompt_token_ids[:hit]))) if a != b]
        check(not wrong, PREFIX_HIT_TOKENS, lambda: (
            f"{seq.request_id} matched {hit} tokens {seq.prompt_token_ids[:hit]}, but at positions {wrong} its "
            f"blocks {self.table(seq, hit)} hold the K/V of other tokens or of the same tokens after another "
            f"prefix"))

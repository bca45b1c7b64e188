"""KVTierContract: what a KV tier below the device pool must do (`servelab.kit.HostTier`
and anything built like it).

    from servelab.testing import KVTierContract

    class TestMine(KVTierContract):
        factory = MyTier               # factory(num_blocks, block_size, eviction) -> tier

The contract keeps a simulated cache in both tiers that stores, per block, the tokens
whose K/V the runner would store there, and performs the tier's recorded moves
(`take_moves`) in order, as the runner does. So a tier that loads the wrong host block,
or records its moves out of order, shows up as a sequence reading tokens it never wrote.
"""

from __future__ import annotations

import random
from typing import Any

from servelab.interfaces import AllocatorContext, KVMove, chained_block_hash, ROOT_BLOCK_HASH
from servelab.testing.contract import _class_attribute, check, exercising

READS_WHAT_IT_WROTE = "a swapped-in sequence reads exactly the K/V it wrote"
PREFIX_COMES_BACK = "a prefix block brought back from the host tier holds what went down"
CONSERVED = "blocks are conserved in each tier"
MOVES_WELL_FORMED = "moves name blocks of their tiers"


class TwoTierCache:
    """Token tuples per device and host block, moved as the runner moves K/V."""

    def __init__(self, device_blocks: int, host_blocks: int) -> None:
        self.device: list[Any] = [None] * device_blocks
        self.host: list[Any] = [None] * host_blocks

    def perform(self, moves: list[KVMove]) -> None:
        for move in moves:
            source, destination = {"offload": (self.device, self.host), "load": (self.host, self.device),
                                   "copy": (self.device, self.device)}[move.kind]
            check(0 <= move.source < len(source) and 0 <= move.destination < len(destination), MOVES_WELL_FORMED,
                  repr(move))
            destination[move.destination] = source[move.source]


def check_conserved(tier: Any) -> None:
    """Every host block is exactly one of free, cached, swapped; the stats agree."""
    where = tier.slots()
    everything = [slot for kind in ("free", "cached", "swapped") for slot in where[kind]]
    check(sorted(everything) == list(range(tier.num_blocks)), CONSERVED,
          lambda: f"host blocks free {sorted(where['free'])}, cached {sorted(where['cached'])}, "
                  f"swapped {sorted(where['swapped'])} do not partition 0..{tier.num_blocks - 1}")
    stats = tier.stats()
    check(stats.num_host_free + stats.num_host_cached + stats.num_host_swapped == stats.num_host_blocks
          and stats.num_host_free == len(where["free"]), CONSERVED, repr(stats))


class KVTierContract:
    """Invariants (each failure message starts "invariant violated: <name>"):

    - a swapped-in sequence reads exactly the K/V it wrote
    - a prefix block brought back from the host tier holds what went down
    - blocks are conserved in each tier (host: free + cached + swapped, each block once;
      device: the allocator's used + free + cached, with the tier below its prefix cache)
    - moves name blocks of their tiers
    """

    factory: Any = None
    num_host_blocks = 12
    block_size = 4

    def make(self) -> Any:
        factory = _class_attribute(type(self), "factory")  # a function stays unbound
        return factory(self.num_host_blocks, self.block_size, None)

    def test_swap_round_trip(self):
        tier = self.make()
        rng = random.Random(0)
        cache = TwoTierCache(32, tier.num_blocks)
        free_device = list(range(32))
        rng.shuffle(free_device)
        written: dict[str, list[int]] = {}
        for step in range(40):
            seq_id = f"s{step % 6}"
            if tier.is_swapped(seq_id):
                blocks = [free_device.pop() for _ in range(tier.num_swapped_blocks(seq_id))]
                with exercising(READS_WHAT_IT_WROTE):
                    tier.swap_in(seq_id, blocks)
                cache.perform(tier.take_moves())
                got = [cache.device[b] for b in blocks]
                check(got == [(seq_id, i, written[seq_id][i]) for i in range(len(blocks))], READS_WHAT_IT_WROTE,
                      lambda: f"{seq_id} wrote {written[seq_id]}, read {got}")
                free_device.extend(blocks)
                # The freed device blocks are overwritten by someone else before the next swap-in.
                for block in blocks:
                    cache.device[block] = ("other", step)
            elif len(free_device) >= 3:
                blocks = [free_device.pop() for _ in range(rng.randint(1, 3))]
                written[seq_id] = [rng.randrange(1000) for _ in blocks]
                for i, block in enumerate(blocks):
                    cache.device[block] = (seq_id, i, written[seq_id][i])
                with exercising(READS_WHAT_IT_WROTE):
                    swapped = tier.swap_out(seq_id, blocks)
                cache.perform(tier.take_moves())
                free_device.extend(blocks)  # the device blocks are free again once swapped (or recomputed)
                for block in blocks:
                    cache.device[block] = ("reused", step)
                if not swapped:
                    written.pop(seq_id)
            check_conserved(tier)

    def test_prefix_blocks_come_back(self):
        tier = self.make()
        cache = TwoTierCache(8, tier.num_blocks)
        parent, names = ROOT_BLOCK_HASH, []
        for index in range(tier.num_blocks + 4):  # more than fit: the oldest are evicted
            tokens = tuple(range(index * self.block_size, (index + 1) * self.block_size))
            key = chained_block_hash(parent, tokens)
            cache.device[index % 8] = tokens
            tier.offload(key, parent, tokens, index + 1, index % 8)
            cache.perform(tier.take_moves())
            names.append((key, parent, tokens))
            parent = key
            check_conserved(tier)
        found = 0
        for key, parent, tokens in names:
            if tier.lookup(key, parent, tokens):
                cache.device[3] = ("stale",)
                tier.load(key, 3)
                cache.perform(tier.take_moves())
                check(cache.device[3] == tokens, PREFIX_COMES_BACK, lambda: f"expected {tokens}, got {cache.device[3]}")
                check(not tier.lookup(key, parent, tokens), CONSERVED, "a loaded block stayed in the host tier")
                found += 1
            check_conserved(tier)
        check(found > 0, PREFIX_COMES_BACK, "nothing offloaded could be found again")

    def test_lookup_confirms_tokens(self):
        tier = self.make()
        tokens = tuple(range(self.block_size))
        key = chained_block_hash(ROOT_BLOCK_HASH, tokens)
        tier.offload(key, ROOT_BLOCK_HASH, tokens, 1, 0)
        check(not tier.lookup(key, ROOT_BLOCK_HASH, tokens[::-1]), PREFIX_COMES_BACK,
              "a lookup with other tokens under the same name hit")

    def test_device_and_host_conserved_under_a_prefix_cache(self):
        """The tier below the kit's prefix cache: random admissions, finishes and evictions
        keep both tiers' blocks accounted for, and every hit reads its own tokens."""
        from servelab.interfaces import Sequence
        from servelab.sampling_params import SamplingParams
        from servelab.testing.contract import installed_factory

        tier = self.make()
        num_device = 10
        factory, options = installed_factory("allocators", "radix")
        allocator = factory(options(), AllocatorContext(
            num_blocks=num_device, block_size=self.block_size, max_model_len=64, host_tier=tier))
        cache = TwoTierCache(num_device, tier.num_blocks)
        rng = random.Random(1)
        prompts = [[rng.randrange(50) for _ in range(self.block_size * rng.randint(2, 4) + 1)] for _ in range(5)]
        for step in range(30):
            prompt = prompts[rng.randrange(len(prompts))]
            seq = Sequence(f"r{step}", list(prompt), SamplingParams(), 0.0)
            seq.num_computed_tokens = allocator.match_prefix(seq)
            if not allocator.allocate(seq.request_id, len(prompt)):
                allocator.free(seq.request_id)
                cache.perform(tier.take_moves())
                continue
            cache.perform(tier.take_moves())
            table = allocator.block_table(seq.request_id)
            for index in range(seq.num_computed_tokens // self.block_size):
                expected = tuple(prompt[index * self.block_size:(index + 1) * self.block_size])
                check(cache.device[table[index]] == expected, PREFIX_COMES_BACK,
                      lambda: f"block {index} of a hit holds {cache.device[table[index]]}, expected {expected}")
            for index in range(len(table)):  # the step writes the rest of the prompt
                cache.device[table[index]] = tuple(prompt[index * self.block_size:(index + 1) * self.block_size])
            seq.num_computed_tokens = len(prompt)
            allocator.cache_blocks(seq)
            allocator.free(seq.request_id)
            stats = allocator.stats()
            check(stats.num_used_blocks + stats.num_free_blocks + stats.num_cached_blocks == stats.num_blocks,
                  CONSERVED, repr(stats))
            check_conserved(tier)

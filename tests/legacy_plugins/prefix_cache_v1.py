"""A prefix-caching allocator as a third party wrote it against version 1 of the
allocator contract: KVAllocator plus match_prefix / cache_blocks, no reset_prefix_cache,
no declared contract version. Frozen: do not edit."""

from servelab.interfaces import AllocatorContext, AllocatorStats


class FullBlockCacheV1:
    def __init__(self, options, context: AllocatorContext):
        self.block_size, self.num_blocks = context.block_size, context.num_blocks
        self.free_blocks = list(range(context.num_blocks))
        self.tables, self.lengths, self.refs = {}, {}, [0] * context.num_blocks
        self.cache = {}  # (prefix tokens) -> block; never evicted while held
        self.cached_block = {}  # block -> key
        self.hit_tokens = self.lookup_tokens = self.lookups = 0
        self.pending = {}  # seq -> (hit tokens, looked-up tokens): counted once it is admitted

    def _take(self):
        if not self.free_blocks:
            unheld = [b for b in self.cached_block if self.refs[b] == 0]
            block = unheld[0]
            del self.cache[self.cached_block.pop(block)]
            return block
        return self.free_blocks.pop(0)

    def _available(self):
        return len(self.free_blocks) + sum(1 for b in self.cached_block if self.refs[b] == 0)

    def allocate(self, seq_id, num_tokens):
        table = self.tables.setdefault(seq_id, [])
        needed = -(-num_tokens // self.block_size) - len(table)
        if needed > self._available():
            if not table:
                del self.tables[seq_id]
            return False
        for _ in range(max(0, needed)):
            block = self._take()
            self.refs[block] += 1
            table.append(block)
        self.lengths[seq_id] = max(self.lengths.get(seq_id, 0), num_tokens)
        if seq_id in self.pending:
            hit, looked_up = self.pending.pop(seq_id)
            self.hit_tokens, self.lookup_tokens, self.lookups = (self.hit_tokens + hit,
                                                                 self.lookup_tokens + looked_up, self.lookups + 1)
        return True

    def free(self, seq_id):
        for block in self.tables.pop(seq_id, []):
            self.refs[block] -= 1
            if self.refs[block] == 0 and block not in self.cached_block:
                self.free_blocks.append(block)
        self.lengths.pop(seq_id, None)
        self.pending.pop(seq_id, None)

    def block_table(self, seq_id):
        return self.tables.get(seq_id, [])

    def match_prefix(self, seq):
        tokens, blocks = seq.prompt_token_ids + seq.output_token_ids, []
        for end in range(self.block_size, seq.num_tokens, self.block_size):
            block = self.cache.get(tuple(tokens[:end]))
            if block is None:
                break
            blocks.append(block)
        for block in blocks:
            self.refs[block] += 1
        self.tables[seq.request_id] = blocks
        self.lengths[seq.request_id] = len(blocks) * self.block_size
        self.pending[seq.request_id] = (len(blocks) * self.block_size, seq.num_tokens)
        return len(blocks) * self.block_size

    def cache_blocks(self, seq):
        tokens = seq.prompt_token_ids + seq.output_token_ids
        table = self.tables.get(seq.request_id, [])
        for index in range(min(seq.num_computed_tokens, len(tokens)) // self.block_size):
            key = tuple(tokens[:(index + 1) * self.block_size])
            if key not in self.cache and table[index] not in self.cached_block:
                self.cache[key], self.cached_block[table[index]] = table[index], key

    def stats(self):
        used = sum(1 for r in self.refs if r)
        filled = {}  # used block -> tokens it holds (the fullest sequence sharing it)
        for seq_id, table in self.tables.items():
            for index, block in enumerate(table):
                tokens = min(self.block_size, max(0, self.lengths.get(seq_id, 0) - index * self.block_size))
                filled[block] = max(filled.get(block, 0), tokens)
        slots = sum(filled.values())
        return AllocatorStats(num_blocks=self.num_blocks, num_used_blocks=used,
                              num_free_blocks=len(self.free_blocks),
                              num_cached_blocks=self.num_blocks - used - len(self.free_blocks),
                              num_token_slots_used=slots, num_token_slots_reserved_empty=used * self.block_size - slots,
                              prefix_hit_tokens=self.hit_tokens, prefix_lookup_tokens=self.lookup_tokens,
                              num_prefix_lookups=self.lookups, block_size=self.block_size)

"""Mixed batches for the attention contract, checked against dense attention.

A backend chooses its own cache layout, so the contract never writes the cache
itself: every token reaches the cache through the backend's `forward`, over three steps
that each check every output row against `dense_reference`:

1. the cached prefix of each sequence, as a prefill (sequences without one sit out);
2. the new tokens: prompts, chunks on top of a cache, decodes, in one mixed batch;
3. copy-on-write: each sequence's last block is copied to a spare block along
   `kv_cache_block_dim()`, the way the runner copies, its table is pointed at the copy,
   and every sequence decodes one more token.

Block tables are in shuffled physical order, padded with 0, and the cache starts
filled with noise, so reading a slot outside the context changes the output. A backend
that declares `requires_contiguous_block_tables` gets what a contiguous allocator
(`naive`) gives instead: each table one run of consecutive blocks, the runs in shuffled
order with gaps between them, and step 3 copies a sequence's whole run into a spare run
(as `naive` forks) rather than its last block.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from servelab.interfaces import AttentionContext, AttentionMetadata
from servelab.testing.contract import check
from servelab.testing.attention_pairing import needs_contiguous_tables
from servelab.tier_copy import copy_indexed

DENSE = "attention output equals dense causal attention (within dtype tolerance)"
WRITES_ONLY_ITS_SLOTS = "forward writes only the slots of the slot mapping"
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}


def dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_len: int, scale: float) -> torch.Tensor:
    """Causal attention of the last `query_len` positions (q [query_len, h, d]) over
    k / v [context, kvh, d], GQA by repetition, in float32."""
    q, k, v = q.float(), k.float(), v.float()
    context_len, num_kv_heads, _ = k.shape
    group = q.shape[1] // num_kv_heads
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,chd->hqc", q[:query_len], k) * scale
    # query i sits at position context_len - query_len + i and sees the positions up to it
    positions = torch.arange(context_len, device=q.device)
    last_seen = torch.arange(context_len - query_len, context_len, device=q.device)
    scores = scores.masked_fill(positions[None, None, :] > last_seen[None, :, None], float("-inf"))
    return torch.einsum("hqc,chd->qhd", torch.softmax(scores, dim=-1), v)


def metadata_for(tables: list[list[int]], query_lens: list[int], context_lens: list[int], block_size: int,
                 device: Any) -> AttentionMetadata:
    """The step's AttentionMetadata, laid out as the runner lays it out."""
    slots = []
    for table, query_len, context_len in zip(tables, query_lens, context_lens):
        positions = range(context_len - query_len, context_len)
        slots += [table[p // block_size] * block_size + p % block_size for p in positions]
    width = max(len(t) for t in tables)
    starts = [0]
    for query_len in query_lens:
        starts.append(starts[-1] + query_len)

    def tensor(values):
        return torch.tensor(values, dtype=torch.int64, device=device)

    return AttentionMetadata(
        query_start_loc=tensor(starts), query_lens=tensor(query_lens), context_lens=tensor(context_lens),
        block_tables=tensor([t + [0] * (width - len(t)) for t in tables]), slot_mapping=tensor(slots),
        max_query_len=max(query_lens), max_context_len=max(context_lens),
        query_lens_list=tuple(query_lens), context_lens_list=tuple(context_lens))


class BatchCheck:
    """Runs the three steps over `shapes` [(cached tokens, new tokens), ...]."""

    def __init__(self, make_backend: Any, *, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 shapes: list[tuple[int, int]], dtype: torch.dtype, device: Any, scale: float, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.shapes = shapes
        self.block_size = block_size
        self.dtype, self.device, self.scale = dtype, torch.device(device), scale
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        # Room for every sequence's tokens, one more decode and one copied block each, plus spares.
        lengths = [math.ceil((c + n + 1) / block_size) for c, n in shapes]  # blocks per table
        self.num_blocks = sum(lengths) * 2 + 4 * len(shapes) + 3  # spare runs and gaps for contiguous tables
        self.backend = make_backend(AttentionContext(
            num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
            num_blocks=self.num_blocks, dtype=dtype, device=self.device))
        self.contiguous = needs_contiguous_tables(self.backend)
        shape = tuple(self.backend.kv_cache_shape())
        self.block_dim = self.backend.kv_cache_block_dim()
        check(shape[self.block_dim] == self.num_blocks, "kv_cache_block_dim() indexes the cache's blocks",
              f"kv_cache_shape() {shape}, block dim {self.block_dim}, {self.num_blocks} blocks")
        self.key_cache = self._randn(shape).mul_(4)
        self.value_cache = self._randn(shape).mul_(4)
        if self.contiguous:
            self._contiguous_tables(lengths)
        else:
            physical = torch.randperm(self.num_blocks, generator=self.generator).tolist()
            self.spares = physical[: len(shapes)]
            free = physical[len(shapes):]
            self.tables = [[free.pop() for _ in range(length)] for length in lengths]
        total = [c + n + 1 for c, n in shapes]
        self.keys = [self._randn((t, num_kv_heads, head_dim)) for t in total]
        self.values = [self._randn((t, num_kv_heads, head_dim)) for t in total]
        self.queries = [self._randn((t, num_heads, head_dim)) for t in total]

    def _contiguous_tables(self, lengths: list[int]) -> None:
        """A table and a spare run per sequence, the runs in shuffled order, 0-2 blocks apart."""
        runs = [(index, spare) for index in range(len(lengths)) for spare in (False, True)]
        order = torch.randperm(len(runs), generator=self.generator).tolist()
        gaps = torch.randint(0, 3, (len(runs),), generator=self.generator).tolist()
        self.tables = [[] for _ in lengths]
        self.spare_runs = [[] for _ in lengths]
        start = 0
        for position, gap in zip(order, gaps):
            index, spare = runs[position]
            start += gap
            (self.spare_runs if spare else self.tables)[index] = list(range(start, start + lengths[index]))
            start += lengths[index]
        assert start <= self.num_blocks

    def _randn(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randn(shape, generator=self.generator).to(self.dtype).to(self.device)

    def run(self) -> None:
        rows = [i for i, (cached, _) in enumerate(self.shapes) if cached]
        if rows:
            self.step("cached prefixes", rows, [(0, self.shapes[i][0]) for i in rows])
        everyone = list(range(len(self.shapes)))
        self.step("mixed batch", everyone, [(c, c + n) for c, n in self.shapes])
        self.copy_last_blocks()
        self.step("decode after block copies", everyone, [(c + n, c + n + 1) for c, n in self.shapes])

    def step(self, name: str, rows: list[int], spans: list[tuple[int, int]]) -> None:
        """Positions [start, end) of each sequence in `rows` are this step's queries."""
        tables = [self.tables[i] for i in rows]
        query_lens = [end - start for start, end in spans]
        context_lens = [end for _, end in spans]
        metadata = metadata_for(tables, query_lens, context_lens, self.block_size, self.device)
        untouched = self._blocks_outside(tables, context_lens)
        before = [self._block(cache, untouched) for cache in (self.key_cache, self.value_cache)]
        cat = torch.cat
        query = cat([self.queries[i][s:e] for i, (s, e) in zip(rows, spans)])
        key = cat([self.keys[i][s:e] for i, (s, e) in zip(rows, spans)])
        value = cat([self.values[i][s:e] for i, (s, e) in zip(rows, spans)])
        out = self.backend.forward(query, key, value, self.key_cache, self.value_cache,
                                   self.backend.prepare(metadata), self.scale)
        check(tuple(out.shape) == tuple(query.shape), DENSE, f"{name}: output shape {tuple(out.shape)}, "
                                                             f"queries {tuple(query.shape)}")
        tolerance = TOLERANCE[self.dtype]
        start = 0
        for i, (s, e) in zip(rows, spans):
            expected = dense_reference(self.queries[i][s:e], self.keys[i][:e], self.values[i][:e], e - s, self.scale)
            got = out[start:start + e - s].float().cpu()
            error = (got - expected.cpu()).abs().max().item()
            check(torch.allclose(got, expected.cpu(), rtol=tolerance, atol=tolerance), DENSE, lambda: (
                f"{name}: sequence {i} (context {e}, {e - s} queries), max abs error {error:.3g} > {tolerance:g} "
                f"[{self.num_heads} heads / {self.num_kv_heads} KV heads, head_dim {self.head_dim}, "
                f"block size {self.block_size}, {str(self.dtype).replace('torch.', '')}, scale {self.scale:.4g}]"))
            start += e - s
        after = [self._block(cache, untouched) for cache in (self.key_cache, self.value_cache)]
        check(all(torch.equal(a, b) for a, b in zip(before, after)), WRITES_ONLY_ITS_SLOTS,
              f"{name}: blocks no sequence holds changed")

    def copy_last_blocks(self) -> None:
        """Copy-on-write as the runner does it: whole blocks along kv_cache_block_dim()."""
        sources, destinations = [], []
        for index, (cached, new) in enumerate(self.shapes):
            last = (cached + new) // self.block_size  # the block the next token lands in
            if self.contiguous:  # the whole run moves, so the table stays one run
                sources += self.tables[index][: last + 1]
                destinations += self.spare_runs[index][: last + 1]
                self.tables[index] = self.spare_runs[index]
            elif last < len(self.tables[index]) and (cached + new) % self.block_size:
                sources.append(self.tables[index][last])
                destinations.append(self.spares[index])
                self.tables[index][last] = self.spares[index]
        if not sources:
            return
        index_from = torch.tensor(sources, device=self.device)
        index_to = torch.tensor(destinations, device=self.device)
        for cache in (self.key_cache, self.value_cache):
            copy_indexed(cache, self.block_dim, index_from, index_to)

    def _blocks_outside(self, tables: list[list[int]], context_lens: list[int]) -> list[int]:
        held = {b for table, length in zip(tables, context_lens) for b in table[: math.ceil(length / self.block_size)]}
        return [b for b in range(self.num_blocks) if b not in held]

    def _block(self, cache: torch.Tensor, blocks: list[int]) -> torch.Tensor:
        return cache.index_select(self.block_dim, torch.tensor(blocks, dtype=torch.int64, device=self.device)).clone()

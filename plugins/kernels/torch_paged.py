"""Reference paged attention in torch: the ground truth every other backend matches.

New K/V are scattered into the cache through the slot mapping; attention reads each
sequence's K/V block by block through its block table. No per-token Python loops.

Sequences are attended in groups, decode rows (one query token) apart from multi-token
rows (prompts, chunks, drafts), sorted by length and cut by cost:

- decode groups hold up to `decode_group_tokens` padded context tokens. A group's K is
  gathered (one index_select into a reused buffer small enough to stay in the CPU's
  cache) and scored against its queries in float32; a group whose contexts are equal
  needs no mask. Then one `embedding_bag` per layer sums the value rows, weighted by the
  probabilities, straight from the cache: V is never copied;
- multi-token groups are formed so padding stays small: a sequence joins a group only
  while the group's padded query x context area stays within `prefill_padding` of the
  area its members need, so a 4,000-token prompt never pads 64-token ones to its length.
  K and V are gathered and attended by scaled_dot_product_attention: `is_causal` for a
  group of whole prompts of one length (the kernel skips the masked half), a lower-right
  causal mask otherwise. A sequence verifying a token tree (`AttentionMetadata.tree_parents`)
  is a multi-token row whose mask shows each query row the context before its first row
  and its own root path among the rows (servelab.token_tree).

Cache layout: [num_kv_heads, num_blocks, block_size, head_dim]. Gathering a group's
blocks then yields [kv_heads, seqs, context, head_dim] directly, the layout the attention
wants, with no transpose copy of the gathered K/V.

With a quantized cache (`[engine] kv_cache_dtype`), the last dimension is a quantized row
(kv_quant: one-byte values, then the row's float32 scale); new rows are quantized on their
way in, and each group's gathered K and V are dequantized to float32 before they are
attended (decodes then sum the values by a matmul instead of embedding_bag).
"""

from __future__ import annotations

import attrs
import numpy as np
import torch
import torch.nn.functional as F

from servelab.interfaces import (AttentionContext, AttentionMetadata, QuantizedKVBackend, TreeAttentionBackend,
                                 ancestor_mask, kv_row_elements)
from servelab.plugins.kernels.kv_quant import dequantize_rows, storage_dtype, write_rows
from servelab.plugins.kernels.options import TorchPagedOptions


@attrs.frozen
class _DecodeGroup:
    """Decode rows (one query each) whose scores are computed together."""

    rows: torch.Tensor  # [G] rows of the flattened batch
    # [kvh * G * M] rows of the cache viewed as [kvh * num_blocks, block_size * d]: for each
    # KV head, each sequence's M blocks, row after row.
    cache_rows: torch.Tensor
    context: int  # keys read: the common context length, or M * block_size with a mask
    hidden: torch.Tensor | None  # [1, G, 1, C] bool, True where the key is past the context; None when equal
    weights: tuple[int, int]  # [start, end) of the group's probabilities in the step's flat weights


@attrs.frozen
class _Decode:
    """All decode rows of a step: scores per group, then one weighted sum over V."""

    groups: tuple[_DecodeGroup, ...]
    rows: torch.Tensor  # [N] rows of the flattened batch, sequences in group order
    # Every (KV head, sequence, query head of that KV head) of every group is one bag of
    # value rows (the cache viewed as [kvh * num_blocks * block_size, d]), in group order.
    value_rows: torch.Tensor  # [num weights]
    bag_offsets: torch.Tensor  # [num bags]
    bag_order: torch.Tensor  # [N * h] bag of (sequence, query head), sequences in group order
    num_weights: int


@attrs.frozen
class _PrefillGroup:
    """Multi-token rows attended together, padded to a common query and context length."""

    query_index: torch.Tensor  # [G, Q] row of the flattened batch per query (0 where padded)
    query_valid: torch.Tensor  # [G, Q] bool
    output_rows: torch.Tensor  # [num valid queries] rows of the flattened batch, in (G, Q) order
    cache_rows: torch.Tensor  # as _DecodeGroup.cache_rows
    context: int  # keys read
    mask: torch.Tensor | None  # [G, 1, Q, C] bool visible keys; None: is_causal over equal lengths
    all_valid: bool  # no padded query


@attrs.frozen
class _Prepared:
    slot_mapping: torch.Tensor  # [T]
    decode: _Decode | None
    prefill_groups: tuple[_PrefillGroup, ...]


def decode_groups(context_lens: list[int], max_seqs: int, max_tokens: int) -> list[list[int]]:
    """Indices into `context_lens` cut into groups: sorted by length, each group at most
    `max_seqs` sequences and `max_tokens` padded context tokens (a longer one alone)."""
    groups: list[list[int]] = []
    current: list[int] = []
    for index in sorted(range(len(context_lens)), key=context_lens.__getitem__):
        # Sorted ascending: the newcomer is the group's longest.
        if current and (len(current) >= max_seqs or (len(current) + 1) * context_lens[index] > max_tokens):
            groups.append(current)
            current = []
        current.append(index)
    if current:
        groups.append(current)
    return groups


def prefill_groups(query_lens: list[int], context_lens: list[int], max_seqs: int, padding: float,
                   max_area: int) -> list[list[int]]:
    """Indices cut into groups whose padded area (seqs x longest query x longest context)
    stays within `padding` times the area the members need, and within `max_area`
    (a sequence whose own area is larger sits alone)."""
    order = sorted(range(len(query_lens)), key=lambda i: (context_lens[i], query_lens[i]))
    groups: list[list[int]] = []
    current: list[int] = []
    need = longest_query = longest_context = 0
    for index in order:
        query, context = query_lens[index], context_lens[index]
        if current:
            n = len(current) + 1
            padded = n * max(longest_query, query) * max(longest_context, context)
            if n > max_seqs or padded > padding * (need + query * context) or padded > max_area:
                groups.append(current)
                current, need, longest_query, longest_context = [], 0, 0, 0
        current.append(index)
        need += query * context
        longest_query, longest_context = max(longest_query, query), max(longest_context, context)
    if current:
        groups.append(current)
    return groups


class _Host:
    """A step's metadata as numpy arrays, for building a group's indices on the host."""

    def __init__(self, metadata: AttentionMetadata, num_kv_heads: int, num_cache_blocks: int) -> None:
        self.device = metadata.query_lens.device
        self.query_lens = np.asarray(metadata.query_lens_list)
        self.context_lens = np.asarray(metadata.context_lens_list)
        self.query_starts = metadata.query_start_loc.cpu().numpy()
        self.block_tables = metadata.block_tables.cpu().numpy()
        self.head_offsets = np.arange(num_kv_heads) * num_cache_blocks
        self.tree_parents = metadata.tree_parents  # per sequence: None, or its query rows' tree

    def cache_rows(self, index: np.ndarray, num_blocks: int) -> np.ndarray:
        """Rows of the cache viewed as [kvh * num_blocks, block_size * d]: for each KV head,
        each sequence's first num_blocks blocks, row after row."""
        block_ids = self.block_tables[index, :num_blocks].reshape(-1)
        return (self.head_offsets[:, None] + block_ids[None, :]).reshape(-1)

    def tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device)


class TorchPagedAttention(QuantizedKVBackend, TreeAttentionBackend):
    supported_kv_cache_dtypes = frozenset({"int8", "fp8_e4m3", "fp8_e5m2"})
    supports_tree_attention = True  # tree rows go to the multi-token path, under an explicit mask

    def __init__(self, options: TorchPagedOptions | None, context: AttentionContext) -> None:
        self.options = options or TorchPagedOptions()
        self.context = context
        self.block_size = context.block_size
        self.kv_cache_dtype = context.kv_cache_dtype
        self.quantized = context.kv_cache_dtype != "auto"
        # Gather buffers for K and V, reused by every group and layer: a fresh tensor per
        # gather pays its page faults (docs/performance.md, "The reference backend").
        self._workspace: list[torch.Tensor] = []

    def kv_cache_shape(self) -> tuple[int, ...]:
        context = self.context
        return (context.num_kv_heads, context.num_blocks, context.block_size,
                kv_row_elements(context.head_dim, context.kv_cache_dtype))

    def kv_cache_block_dim(self) -> int:
        return 1

    def kv_cache_storage_dtype(self) -> torch.dtype:
        return storage_dtype(self.kv_cache_dtype) if self.quantized else self.context.dtype

    # ------------------------------------------------------------ per step

    def prepare(self, metadata: AttentionMetadata) -> _Prepared:
        # Indices are built on the host with numpy (cheaper per call than torch ops) and
        # moved to the device once per group; every layer of the step reuses them.
        options = self.options
        query_lens, context_lens = metadata.query_lens_list, metadata.context_lens_list
        decodes = [i for i, q in enumerate(query_lens) if q == 1]
        multi = [i for i, q in enumerate(query_lens) if q != 1]
        host = _Host(metadata, self.context.num_kv_heads, self.context.num_blocks)
        decode = self._decode(host, [[decodes[i] for i in group] for group in decode_groups(
            [context_lens[i] for i in decodes], options.decode_group_size, options.decode_group_tokens)])
        prefill = tuple(
            self._prefill_group(host, [multi[i] for i in group])
            for group in prefill_groups([query_lens[i] for i in multi], [context_lens[i] for i in multi],
                                        options.prefill_group_size, options.prefill_padding,
                                        options.prefill_group_area))
        return _Prepared(metadata.slot_mapping, decode, prefill)

    def _decode(self, host: "_Host", groups: list[list[int]]) -> _Decode | None:
        if not groups:
            return None
        context = self.context
        group_size = context.num_heads // context.num_kv_heads
        heads = np.arange(context.num_kv_heads)[:, None, None, None] * (context.num_blocks * self.block_size)
        prepared, value_rows, bag_lengths, bag_order = [], [], [], []
        num_weights = num_bags = 0
        for seqs in groups:
            index = np.asarray(seqs)
            lens = host.context_lens[index]
            longest = int(lens.max())
            num_blocks = -(-longest // self.block_size)
            hidden = None
            keys = longest
            if int(lens.min()) != longest:
                keys = num_blocks * self.block_size
                hidden = host.tensor((np.arange(keys)[None, :] >= lens[:, None]).reshape(1, len(seqs), 1, keys))
            # Slots of each sequence's first `keys` positions ([G, keys]); padding reads block 0, weight 0.
            slots = (host.block_tables[index, :num_blocks, None] * self.block_size
                     + np.arange(self.block_size)).reshape(len(seqs), -1)[:, :keys]
            rows = np.broadcast_to(heads + slots[None, :, None, :],
                                   (context.num_kv_heads, len(seqs), group_size, keys))  # bag order [kvh, G, g]
            value_rows.append(rows.reshape(-1))
            num_group_bags = rows.shape[0] * rows.shape[1] * rows.shape[2]
            bag_lengths.append(np.full(num_group_bags, keys))
            # Bag of (sequence j, query head kv * g + i) is num_bags + (kv * G + j) * g + i.
            bag_order.append(num_bags + np.arange(num_group_bags).reshape(
                context.num_kv_heads, len(seqs), group_size).transpose(1, 0, 2).reshape(-1))
            prepared.append(_DecodeGroup(host.tensor(host.query_starts[index]),
                                         host.tensor(host.cache_rows(index, num_blocks)), keys, hidden,
                                         (num_weights, num_weights + rows.size)))
            num_weights += rows.size
            num_bags += num_group_bags
        lengths = np.concatenate(bag_lengths)
        offsets = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1], out=offsets[1:])
        all_seqs = np.concatenate([np.asarray(g) for g in groups])
        return _Decode(tuple(prepared), host.tensor(host.query_starts[all_seqs]),
                       host.tensor(np.concatenate(value_rows)), host.tensor(offsets),
                       host.tensor(np.concatenate(bag_order)), num_weights)

    def _prefill_group(self, host: "_Host", seqs: list[int]) -> _PrefillGroup:
        index = np.asarray(seqs)
        q_lens, c_lens = host.query_lens[index], host.context_lens[index]
        max_query, longest = int(q_lens.max()), int(c_lens.max())
        num_blocks = -(-longest // self.block_size)
        query_pos = np.arange(max_query)
        query_valid = query_pos[None, :] < q_lens[:, None]
        query_index = np.where(query_valid, host.query_starts[index, None] + query_pos, 0)
        if (q_lens == c_lens).all() and int(q_lens.min()) == max_query:
            # Whole prompts of one length: is_causal, over exactly their keys.
            mask, context = None, longest
        else:
            context = num_blocks * self.block_size
            key_pos = np.arange(context)
            # Query i of a sequence sits at absolute position context_len - query_len + i.
            absolute = (c_lens - q_lens)[:, None] + query_pos[None, :]
            visible = (key_pos[None, None, :] <= absolute[:, :, None]) & (key_pos < c_lens[:, None, None])
            if host.tree_parents is not None:
                for g, seq in enumerate(seqs):
                    tree = host.tree_parents[seq]
                    if tree is not None:  # a token tree: its rows see their own root path only
                        first = int(c_lens[g] - q_lens[g])
                        visible[g, : len(tree), first: first + len(tree)] = ancestor_mask(tree)
            # Padded queries see every key (their rows are dropped), so no row is all hidden.
            mask = host.tensor((visible | ~query_valid[:, :, None])[:, None])
        return _PrefillGroup(host.tensor(query_index), host.tensor(query_valid), host.tensor(query_index[query_valid]),
                             host.tensor(host.cache_rows(index, num_blocks)), context, mask, bool(query_valid.all()))

    # ------------------------------------------------------------ per layer

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_cache: torch.Tensor, value_cache: torch.Tensor, prepared: _Prepared,
                scale: float) -> torch.Tensor:
        self._write(key, value, key_cache, value_cache, prepared.slot_mapping)
        output = torch.empty_like(query)
        if prepared.decode is not None:
            output.index_copy_(0, prepared.decode.rows,
                               self._attend_decode(query, key_cache, value_cache, prepared.decode, scale))
        for group in prepared.prefill_groups:
            output.index_copy_(0, group.output_rows, self._prefill(query, key_cache, value_cache, group, scale))
        return output

    def _write(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               slot_mapping: torch.Tensor) -> None:
        if self.quantized:
            write_rows(key_cache, slot_mapping, key, self.kv_cache_dtype)
            write_rows(value_cache, slot_mapping, value, self.kv_cache_dtype)
            return
        num_kv_heads, head_dim = key_cache.shape[0], key_cache.shape[3]
        key_cache.view(num_kv_heads, -1, head_dim).index_copy_(1, slot_mapping, key.transpose(0, 1))
        value_cache.view(num_kv_heads, -1, head_dim).index_copy_(1, slot_mapping, value.transpose(0, 1))

    def _gather(self, which: int, cache: torch.Tensor, rows: torch.Tensor, num_seqs: int,
                context: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """[kvh, G, context, d] of a group's K (which=0) or V (which=1), in a reused buffer
        (a quantized cache's rows dequantized, into `dtype`, float32 by default).
        One index_select over dim 0 of a 2-D view copies whole (head, block) rows, the
        fastest gather on the CPU (docs/performance.md, "The reference backend")."""
        if self.quantized:
            cache = cache.view(torch.uint8)
        num_kv_heads, _, block_size, head_dim = cache.shape
        source = cache.view(-1, block_size * head_dim)
        buffers = self._workspace
        if not buffers or buffers[0].dtype != source.dtype or buffers[0].device != source.device \
                or buffers[0].shape[1] != source.shape[1]:
            buffers[:] = [source.new_empty((0, source.shape[1])) for _ in range(2)]
        if buffers[which].shape[0] < rows.shape[0]:
            buffers[which] = source.new_empty((rows.shape[0], source.shape[1]))
        gathered = torch.index_select(source, 0, rows, out=buffers[which][: rows.shape[0]])
        gathered = gathered.view(num_kv_heads, num_seqs, -1, head_dim)[:, :, :context]
        if self.quantized:
            return dequantize_rows(gathered, self.context.head_dim, self.kv_cache_dtype, dtype or torch.float32)
        return gathered

    def _attend_decode(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                       decode: _Decode, scale: float) -> torch.Tensor:
        """Per group: gather K (a cache-sized copy), scores and softmax in float32, into the
        step's flat weights. Then one embedding_bag sums the weighted V rows straight from
        the cache, with no copy of V (cheaper than gathering V too; docs/performance.md)."""
        num_heads, head_dim = query.shape[1], query.shape[2]
        num_kv_heads = key_cache.shape[0]
        if self.quantized:
            return self._attend_decode_quantized(query, key_cache, value_cache, decode, scale)
        weights = torch.empty(decode.num_weights, dtype=query.dtype, device=query.device)
        for group in decode.groups:
            num_seqs = group.rows.shape[0]
            keys = self._gather(0, key_cache, group.cache_rows, num_seqs, group.context)
            # The query heads sharing a KV head are its rows: [G, h, d] -> [kvh, G, g, d].
            q = query.index_select(0, group.rows).view(num_seqs, num_kv_heads, -1, head_dim).transpose(0, 1)
            if q.dtype != torch.float32:  # scores in float32 (half-precision matmul is slow on CPU)
                q, keys = q.float(), keys.float()
            scores = torch.matmul(q, keys.transpose(-1, -2)).mul_(scale)  # [kvh, G, g, C]
            if group.hidden is not None:
                scores.masked_fill_(group.hidden, float("-inf"))
            start, end = group.weights
            weights[start:end].view(scores.shape).copy_(torch.softmax(scores, dim=-1))
        values = value_cache.view(-1, head_dim)
        out = F.embedding_bag(decode.value_rows, values, decode.bag_offsets, mode="sum",
                              per_sample_weights=weights)  # [bags, d]
        return out.index_select(0, decode.bag_order).view(-1, num_heads, head_dim)

    def _attend_decode_quantized(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                                 decode: _Decode, scale: float) -> torch.Tensor:
        """Decode groups over a quantized cache: K and V gathered and dequantized to float32,
        scores, softmax and the weighted sum of values as matmuls; rows in group order."""
        num_heads, head_dim = query.shape[1], query.shape[2]
        num_kv_heads = key_cache.shape[0]
        outputs = []
        for group in decode.groups:
            num_seqs = group.rows.shape[0]
            keys = self._gather(0, key_cache, group.cache_rows, num_seqs, group.context)  # [kvh, G, C, d]
            values = self._gather(1, value_cache, group.cache_rows, num_seqs, group.context)
            q = query.index_select(0, group.rows).view(num_seqs, num_kv_heads, -1, head_dim).transpose(0, 1).float()
            scores = torch.matmul(q, keys.transpose(-1, -2)).mul_(scale)  # [kvh, G, g, C]
            if group.hidden is not None:
                scores.masked_fill_(group.hidden, float("-inf"))
            out = torch.matmul(torch.softmax(scores, dim=-1), values)  # [kvh, G, g, d]
            outputs.append(out.transpose(0, 1).reshape(num_seqs, num_heads, head_dim))
        return torch.cat(outputs).to(query.dtype)

    def _prefill(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 group: _PrefillGroup, scale: float) -> torch.Tensor:
        num_seqs, max_query = group.query_index.shape
        num_heads, head_dim = query.shape[1], query.shape[2]
        # [kvh, G, C, d] -> [G, kvh, C, d]; the query heads of a KV head share it (enable_gqa).
        keys = self._gather(0, key_cache, group.cache_rows, num_seqs, group.context, query.dtype).transpose(0, 1)
        values = self._gather(1, value_cache, group.cache_rows, num_seqs, group.context, query.dtype).transpose(0, 1)
        q = query[group.query_index].transpose(1, 2)  # [G, Q, h, d] -> [G, h, Q, d]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=group.mask, is_causal=group.mask is None,
                                             scale=scale, enable_gqa=num_heads != keys.shape[1])
        out = out.transpose(1, 2)  # [G, Q, h, d]
        return out.reshape(-1, num_heads, head_dim) if group.all_valid else out[group.query_valid]

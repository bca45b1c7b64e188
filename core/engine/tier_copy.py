"""Copies between the device KV cache and the host tier (`[kv_offload]`, docs/kv-tiers.md).

The runner owns both tiers' tensors and hands each batch of a step's offloads (device ->
host) and loads (host -> device) to a copier, chosen by the device (`tier_copier`):

- `CpuTierCopier`: the host tier has the device cache's layout and every copy is a
  synchronous gather and scatter (on the CPU both tiers are host memory).
- `CudaTierCopier`: the host tier is pinned and block-major ([host block, ...the rest of a
  device block]), so a run of consecutive host blocks is one contiguous DMA. Offloads
  gather their blocks on the compute stream (so the device blocks may be reused by the
  forward right after) and copy them to the host on a side stream, non-blocking, with an
  event recorded per host block. Loads copy host -> device on the same side stream (after
  any offload still landing in those host blocks: stream order, and the blocks' events
  for a host-side reader) and the compute stream waits on the side stream before it
  scatters them into the cache, so the step's forward sees them.
"""

from __future__ import annotations

import zlib
from typing import Any, Sequence as Seq

import torch

from servelab.interfaces import KVMove


def copyable(cache: torch.Tensor) -> torch.Tensor:
    """`cache` as a tensor every copy op takes: a one-byte cache (int8, float8) viewed as
    uint8 bytes. The CPU build has no index_copy for float8, and a block or slot copy moves
    bytes whatever they mean, as the quantized write path already does; the view shares
    storage and shape, so a copy into it lands in the cache."""
    return cache.view(torch.uint8) if cache.element_size() == 1 and cache.dtype != torch.uint8 else cache


def copy_indexed(cache: torch.Tensor, dim: int, index_from: torch.Tensor, index_to: torch.Tensor) -> None:
    """cache[..., index_to, ...] = cache[..., index_from, ...] along `dim` (all reads first), any dtype."""
    raw = copyable(cache)
    raw.index_copy_(dim, index_to, raw.index_select(dim, index_from))


def host_runs(host_blocks: Seq[int]) -> list[tuple[int, int, int]]:
    """(first position in the batch, first host block, length) of each run of consecutive
    host blocks at consecutive positions of a batch: one contiguous copy each."""
    runs: list[tuple[int, int, int]] = []
    for position, block in enumerate(host_blocks):
        if runs and runs[-1][1] + runs[-1][2] == block:
            start, first, length = runs[-1]
            runs[-1] = (start, first, length + 1)
        else:
            runs.append((position, block, 1))
    return runs


class HostTierCorrupted(RuntimeError):
    """A host tier block's bytes changed between its offload and its load."""


def block_checksums(blocks: torch.Tensor, dim: int, running: list[int]) -> list[int]:
    """`running` CRC-32s continued with the bytes of each block of `blocks` (blocks on `dim`)."""
    per_block = blocks.movedim(dim, 0).contiguous().view(torch.uint8).reshape(blocks.shape[dim], -1).numpy()
    return [zlib.crc32(row, crc) for row, crc in zip(per_block, running)]


class CpuTierCopier:
    """Synchronous copies; the host tier in the device cache's layout (blocks on `block_dim`).
    Every load checks the bytes against the checksum taken at the offload (HostTierCorrupted)."""

    asynchronous = False

    def __init__(self, host_caches: list[tuple[torch.Tensor, torch.Tensor]], block_dim: int) -> None:
        self.host_caches = host_caches
        self.block_dim = block_dim
        # host block -> CRC-32 of its bytes in every layer's K and V when offloaded: a load
        # verifies the bytes, so a hit is never trusted on the tier's bookkeeping alone
        self.checksums: dict[int, int] = {}

    def offload(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], sources: Seq[int],
                destinations: Seq[int]) -> None:
        dim = self.block_dim
        index_from = torch.tensor(sources, dtype=torch.int64)
        index_to = torch.tensor(destinations, dtype=torch.int64)
        sums = [0] * len(destinations)
        for pair, host_pair in zip(kv_caches, self.host_caches):
            for cache, host in zip(pair, host_pair):
                blocks = copyable(cache).index_select(dim, index_from.to(cache.device)).to(host.device)
                sums = block_checksums(blocks, dim, sums)
                copyable(host).index_copy_(dim, index_to, blocks)
        self.checksums.update(zip(destinations, sums))

    def load(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], sources: Seq[int],
             destinations: Seq[int]) -> None:
        dim = self.block_dim
        index_from = torch.tensor(sources, dtype=torch.int64)
        index_to = torch.tensor(destinations, dtype=torch.int64)
        sums = [0] * len(sources)
        for pair, host_pair in zip(kv_caches, self.host_caches):
            for cache, host in zip(pair, host_pair):
                blocks = copyable(host).index_select(dim, index_from)
                sums = block_checksums(blocks, dim, sums)
                copyable(cache).index_copy_(dim, index_to.to(cache.device), blocks.to(cache.device))
        for block, found in zip(sources, sums):
            expected = self.checksums.get(block)
            if expected is not None and found != expected:
                raise HostTierCorrupted(f"host tier block {block} no longer holds the KV offloaded into it "
                                        f"(checksum {found:#010x}, written {expected:#010x}): something else "
                                        f"wrote the tier's memory or file; refusing to serve from it")

    def host_blocks(self, layer: int, which: int, blocks: Seq[int]) -> torch.Tensor:
        """Host blocks of one layer's K (which=0) or V (1), in the device cache's layout."""
        host = self.host_caches[layer][which]
        return host.index_select(self.block_dim, torch.tensor(list(blocks), dtype=torch.int64))

    def synchronize(self) -> None:
        pass


class CudaTierCopier:
    """Asynchronous copies on a side CUDA stream into a pinned, block-major host tier."""

    asynchronous = True

    def __init__(self, host_caches: list[tuple[torch.Tensor, torch.Tensor]], block_dim: int,
                 device: torch.device) -> None:
        self.host_caches = host_caches  # [num_host_blocks, *device block] per layer, K and V
        self.block_dim = block_dim
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self._landed: dict[int, torch.cuda.Event] = {}  # host block -> its last offload's event

    def offload(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], sources: Seq[int],
                destinations: Seq[int]) -> None:
        compute = torch.cuda.current_stream(self.device)
        index_from = torch.tensor(sources, dtype=torch.int64).to(self.device, non_blocking=True)
        # The gathers run on the compute stream, ordered after the writes of those blocks
        # and before any reuse of them; the side stream picks the gathered blocks up.
        staged = [[copyable(cache).index_select(self.block_dim, index_from).movedim(self.block_dim, 0).contiguous()
                   for cache in pair] for pair in kv_caches]
        self.stream.wait_stream(compute)
        runs = host_runs(destinations)
        with torch.cuda.stream(self.stream):
            for layer_staged, host_pair in zip(staged, self.host_caches):
                for blocks, host in zip(layer_staged, host_pair):
                    blocks.record_stream(self.stream)  # allocated on compute, read here
                    for start, first, length in runs:
                        copyable(host)[first: first + length].copy_(blocks[start: start + length],
                                                                    non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        for block in destinations:
            self._landed[block] = event

    def load(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], sources: Seq[int],
             destinations: Seq[int]) -> None:
        compute = torch.cuda.current_stream(self.device)
        index_to = torch.tensor(destinations, dtype=torch.int64).to(self.device, non_blocking=True)
        runs = host_runs(sources)
        staged = []
        with torch.cuda.stream(self.stream):  # after the offloads into these host blocks: same stream
            for host_pair in self.host_caches:
                layer = []
                for host in host_pair:
                    raw = copyable(host)
                    blocks = torch.empty((len(sources), *raw.shape[1:]), dtype=raw.dtype, device=self.device)
                    for start, first, length in runs:
                        blocks[start: start + length].copy_(raw[first: first + length], non_blocking=True)
                    layer.append(blocks)
                staged.append(layer)
        compute.wait_stream(self.stream)  # the forward after this reads the loaded blocks
        for pair, layer in zip(kv_caches, staged):
            for cache, blocks in zip(pair, layer):
                blocks.record_stream(compute)  # allocated on the side stream, read on compute
                copyable(cache).index_copy_(self.block_dim, index_to, blocks.movedim(0, self.block_dim))
        for block in sources:
            self._landed.pop(block, None)

    def wait_host(self, blocks: Seq[int]) -> None:
        """Block the host until the offloads into `blocks` have landed (a reader of the host tensors)."""
        for event in {id(e): e for e in (self._landed.get(b) for b in blocks) if e is not None}.values():
            event.synchronize()

    def host_blocks(self, layer: int, which: int, blocks: Seq[int]) -> torch.Tensor:
        """Host blocks of one layer's K (which=0) or V (1), in the device cache's layout,
        once their offloads have landed."""
        self.wait_host(blocks)
        host = self.host_caches[layer][which]
        return host.index_select(0, torch.tensor(list(blocks), dtype=torch.int64)).movedim(0, self.block_dim)

    def synchronize(self) -> None:
        self.stream.synchronize()
        self._landed.clear()


def tier_copier(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_dim: int, num_host_blocks: int,
                path: str | None, device: torch.device, allocate: Any) -> CpuTierCopier | CudaTierCopier:
    """The copier for `device`, with its host tier allocated: `allocate(shape, dtype,
    num_layers, path, pin)` (runner.host_kv_caches) in the device cache's layout on the CPU,
    block-major and pinned (unless memory-mapped from `path`) on CUDA."""
    key = kv_caches[0][0]
    shape = list(key.shape)
    if device.type == "cuda":
        block_shape = shape[:block_dim] + shape[block_dim + 1:]
        host = allocate((num_host_blocks, *block_shape), key.dtype, len(kv_caches), path, True)
        return CudaTierCopier(host, block_dim, device)
    shape[block_dim] = num_host_blocks
    return CpuTierCopier(allocate(tuple(shape), key.dtype, len(kv_caches), path, False), block_dim)


def move_batches(moves: Seq[KVMove]):
    """(kind, sources, destinations) runs of `moves` safe to perform as one gather and one
    scatter: the same kind, no destination repeated, no source written earlier in the run."""
    batch: list[KVMove] = []
    written: set[tuple[str, int]] = set()
    for move in moves:
        source_tier = "host" if move.kind == "load" else "device"
        destination_tier = "host" if move.kind == "offload" else "device"
        if batch and (move.kind != batch[0].kind or (source_tier, move.source) in written
                      or (destination_tier, move.destination) in written):
            yield batch[0].kind, [m.source for m in batch], [m.destination for m in batch]
            batch, written = [], set()
        batch.append(move)
        written.add((destination_tier, move.destination))
    if batch:
        yield batch[0].kind, [m.source for m in batch], [m.destination for m in batch]


def perform_moves(copier: CpuTierCopier | CudaTierCopier | None, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                  block_dim: int, moves: Seq[KVMove]) -> None:
    """A step's moves, in order, in every layer's K and V: offloads and loads by the
    copier, copy-on-write copies on the device (the current stream)."""
    for kind, sources, destinations in move_batches(moves):
        if kind == "offload":
            copier.offload(kv_caches, sources, destinations)
        elif kind == "load":
            copier.load(kv_caches, sources, destinations)
        else:
            device = kv_caches[0][0].device
            index_from = torch.tensor(sources, dtype=torch.int64, device=device)
            index_to = torch.tensor(destinations, dtype=torch.int64, device=device)
            for pair in kv_caches:
                for cache in pair:
                    copy_indexed(cache, block_dim, index_from, index_to)

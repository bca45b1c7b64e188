"""The router contract (kind `routers`, `[router]`): the request (`RouteRequest`) and the
replica snapshots a router chooses among, its factory context, the Protocol and its
optional capability, and the chained block hashes a prefix-aware router shares with the
`hash` allocator. Changes by version: docs/contract-versions.md ("routers").
"""

from __future__ import annotations

from typing import Protocol, Sequence as Seq, runtime_checkable

import attrs

from servelab.defaults import BLOCK_SIZE

__all__ = [
    "ROOT_BLOCK_HASH",
    "chained_block_hash",
    "prefix_block_hashes",
    "PrefixSummary",
    "ReplicaSnapshot",
    "RouteRequest",
    "RouterContext",
    "Router",
    "FinishAwareRouter",
    "PrefixReportingAllocator",
]


ROOT_BLOCK_HASH = 0x5E4E1AB  # the parent of block 0 (a constant: str hashes vary per process)


def chained_block_hash(parent_hash: int, tokens: tuple[int, ...]) -> int:
    """The name of a KV block holding `tokens` right after the prefix named `parent_hash`
    (ROOT_BLOCK_HASH for block 0): it stands for the whole prefix the block ends, not for
    its own tokens alone. Integers and tuples of integers hash the same in every process,
    so a router and a replica in another process agree on it; the `hash` allocator names
    its cached blocks with it."""
    return hash((parent_hash, tokens))


def prefix_block_hashes(token_ids: Seq[int], block_size: int, lora_id: int = 0) -> list[int]:
    """Chained hashes (`chained_block_hash`) of the full blocks of `token_ids`: hash i
    covers tokens [0, (i + 1) * block_size), so two prompts share hash i exactly when they
    share those tokens. Under a LoRA adapter (`lora_id` > 0) block 0 is named with the
    adapter's id negated first, as the prefix cache names it (servelab.kit.prefix.block_chunk),
    so no hash of one adapter's blocks is another's, or the base model's."""
    hashes = []
    parent = ROOT_BLOCK_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        chunk = tuple(token_ids[start:start + block_size])
        parent = chained_block_hash(parent, (-lora_id, *chunk) if start == 0 and lora_id else chunk)
        hashes.append(parent)
    return hashes


@attrs.frozen
class PrefixSummary:
    """What a replica's prefix cache holds: the chained hashes (`prefix_block_hashes`)
    of the blocks it can serve from cache, all of one block size."""

    block_size: int
    block_hashes: frozenset[int] = attrs.field(factory=frozenset, converter=frozenset)

    def cached_tokens(self, token_ids: Seq[int]) -> int:
        """Tokens of `token_ids`' longest prefix the cache holds (a multiple of block_size)."""
        num_blocks = 0
        for block_hash in prefix_block_hashes(token_ids, self.block_size):
            if block_hash not in self.block_hashes:
                break
            num_blocks += 1
        return num_blocks * self.block_size


@attrs.frozen
class ReplicaSnapshot:
    """One engine replica's load as a router sees it when a request arrives.

    A simulated fleet reads it off each replica's scheduler and allocator; live replicas
    report the same fields (`servelab.routing.replica_snapshot(engine, replica_id)`).
    """

    replica_id: int  # stable for the replica's life; not its position in the list
    num_waiting: int = 0  # sequences queued, not running (new, or preempted)
    num_running: int = 0  # sequences running (holding a batch slot)
    num_queued_tokens: int = 0  # tokens of the waiting sequences still to compute (their prefill work)
    num_running_tokens: int = 0  # tokens (context) of the running sequences
    num_kv_blocks: int = 0  # blocks in the replica's KV pool
    num_used_kv_blocks: int = 0  # blocks held by sequences
    block_size: int = BLOCK_SIZE  # token slots per KV block
    prefix_summary: PrefixSummary | None = None  # the replica's cached prefixes, where it reports them
    # Names of the LoRA adapters in the replica's fast pool (empty: none, or no LoRA).
    resident_adapters: frozenset[str] = attrs.field(factory=frozenset, converter=frozenset)

    @property
    def load_tokens(self) -> int:
        """Queued plus running tokens: the work `least-loaded` balances."""
        return self.num_queued_tokens + self.num_running_tokens


@attrs.frozen
class RouteRequest:
    """What a router knows of a request when it chooses a replica."""

    request_id: str
    prompt_token_ids: Seq[int]
    max_tokens: int = 16
    arrival_time: float = 0.0
    # A key the caller gives requests of one conversation or user (None: none given), so a
    # router may keep a session on one replica.
    session: str | None = None
    adapter: str | None = None  # the LoRA adapter it runs with (LoRARequest.lora_name); None: the base model
    # That adapter's LoRARequest.lora_int_id (0: the base model): a prefix cache names the
    # blocks of a request under an adapter with it (prefix_block_hashes' lora_id).
    lora_id: int = 0


@attrs.frozen
class RouterContext:
    """What a router factory receives: the fleet it routes over."""

    num_replicas: int  # replicas at start; ids are 0..num_replicas-1 (some may later leave)
    block_size: int = BLOCK_SIZE  # KV block size of the replicas (for prefix hashing)
    num_kv_blocks: int = 0  # each replica's KV pool (0: unknown), for sizing an approximate prefix view
    seed: int = 0  # for routers that draw random numbers: draw them from a generator seeded with this


@runtime_checkable
class Router(Protocol):
    """Chooses the replica that serves each request.

    `route` gets the snapshots of the replicas that can take work now (a dead or drained
    replica is absent, so the list may skip ids) and returns the `replica_id` of one of
    them; it is never called with an empty list. Given the same calls in the same order
    (requests and snapshots), a router makes the same choices. A router may keep its own
    approximate view of what it routed where (as SGLang's cache-aware router keeps a
    prefix tree per worker), and may define `request_finished(request_id, replica_id)`,
    called once when a request it routed finishes, fails or is aborted.
    """

    def route(self, request: RouteRequest, replicas: Seq[ReplicaSnapshot]) -> int:
        """The replica_id of one of `replicas`."""


@runtime_checkable
class FinishAwareRouter(Protocol):
    """A router that keeps its own view of what it routed where."""

    def request_finished(self, request_id: str, replica_id: int) -> None:
        """A request it routed finished, failed or was aborted (called once)."""


@runtime_checkable
class PrefixReportingAllocator(Protocol):
    """An allocator that reports what its prefix cache holds, in the names routers read
    (the `hash` and `radix` allocators): a simulated fleet hands each replica's summary
    to the router as `ReplicaSnapshot.prefix_summary` at every arrival, so it should be
    cheap to call (kept as blocks enter and leave, not recomputed)."""

    def prefix_summary(self) -> PrefixSummary:
        """The chained hashes of every block the cache can serve, at its block size."""

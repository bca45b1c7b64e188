"""The policy contracts: what an allocator, scheduler, drafter, attention backend and
router must provide, and the frozen records the engine's stages hand each other.

Plugins import from here (and from `servelab`), never from other core modules.
"""

from __future__ import annotations

from operator import itemgetter
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, Sequence as Seq, runtime_checkable

import attrs

from servelab.sequence import Sequence, SequenceStatus
from servelab.token_tree import ancestor_mask, query_parents, tree_error
from servelab.model.kv_sizing import (KV_CACHE_DTYPES, QUANTIZED_KV_MAX, QUANTIZED_KV_TORCH_DTYPE, kv_row_elements,
                                     kv_scale_offset)

if TYPE_CHECKING:  # torch stays out of imports that plugin discovery triggers
    import torch

__all__ = [
    "AllocatorContext",
    "AllocatorStats",
    "AcceptingDrafter",
    "AnticipatingPrefixCache",
    "AttentionBackend",
    "AttentionContext",
    "AttentionMetadata",
    "ContiguousAllocator",
    "ClosingProcessor",
    "ContiguousBlockTablesBackend",
    "Draft",
    "Drafter",
    "DrafterContext",
    "DemandAwareEviction",
    "EvictionCandidate",
    "EvictionContext",
    "EvictionPolicy",
    "FeatureDrafter",
    "FeatureRunner",
    "FinishAwareDrafter",
    "FinishAwareRouter",
    "ForkingAllocator",
    "ForkingScheduler",
    "HiddenStateDrafter",
    "KVAllocator",
    "LMHeadRunner",
    "LayerOpsBackend",
    "LogitsProcessor",
    "LogitsProcessorContext",
    "ModelRunnerLike",
    "NativeDecoderBackend",
    "PanelKernelsBackend",
    "QuantizedKVBackend",
    "KV_CACHE_DTYPES",
    "QUANTIZED_KV_MAX",
    "QUANTIZED_KV_TORCH_DTYPE",
    "kv_row_elements",
    "kv_scale_offset",
    "PrefixCachingAllocator",
    "PrefixSummary",
    "PreparingProcessor",
    "ProcessorRequest",
    "ReleasingDrafter",
    "ReleasingProcessor",
    "ResettablePrefixCache",
    "SlotMovingRunner",
    "ReplicaSnapshot",
    "RouteRequest",
    "Router",
    "RouterContext",
    "Runner",
    "Scheduler",
    "SchedulerContext",
    "SchedulerStats",
    "SelfSelectingProcessor",
    "Sequence",
    "SequenceStatus",
    "StepInputs",
    "StepPlan",
    "TargetModel",
    "TreeAttentionBackend",
    "TreeDrafter",
    "ValidatingProcessor",
    "WarmingProcessor",
    "ROOT_BLOCK_HASH",
    "ancestor_mask",
    "query_parents",
    "tree_error",
    "chained_block_hash",
    "prefix_block_hashes",
    "sampling_rows",
]


# ---------------------------------------------------------------- KV allocation


@attrs.frozen
class AllocatorContext:
    """What the engine tells an allocator factory about the KV cache it manages."""

    num_blocks: int  # physical blocks in the runner's cache
    block_size: int  # token slots per block
    max_model_len: int  # longest sequence the engine admits
    # The eviction policy a prefix cache orders its evictable blocks by (`[eviction]`, an
    # EvictionPolicy); None: the cache's own default (least recently used first).
    eviction: Any = None
    # The KV tier below the device pool (`[kv_offload]`, a servelab.kit.HostTier), or
    # None: a prefix cache offers the blocks it evicts to it and looks misses up in it.
    host_tier: Any = None


@attrs.frozen
class AllocatorStats:
    """The same numbers from every allocator, in blocks and token slots.

    Blocks: num_used_blocks + num_free_blocks + num_cached_blocks == num_blocks.
    Slots of used blocks: num_token_slots_used + num_token_slots_reserved_empty ==
    num_used_blocks * block_size. Wasted KV = reserved-but-empty (internal) plus
    free-but-unusable (external fragmentation).
    """

    num_blocks: int
    num_used_blocks: int  # held by at least one sequence (or reserved for one)
    num_free_blocks: int  # on the free list: allocatable without evicting anything
    num_cached_blocks: int = 0  # held by no sequence, kept for prefix reuse; evictable
    num_token_slots_used: int = 0  # slots of used blocks holding a token's K/V
    num_token_slots_reserved_empty: int = 0  # in used blocks, no token yet (internal waste)
    num_free_slots_unusable: int = 0  # free, but no new sequence could use them (external fragmentation)
    prefix_hit_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    prefix_lookup_tokens: int = 0  # tokens of the sequences looked up in the prefix cache
    num_prefix_lookups: int = 0  # sequences looked up (one per admission)
    block_size: int = 0  # slots per block

    @property
    def num_wasted_slots(self) -> int:
        """Reserved-but-empty plus free-but-unusable slots."""
        return self.num_token_slots_reserved_empty + self.num_free_slots_unusable

    @property
    def waste_fraction(self) -> float:
        """Wasted slots as a fraction of the whole pool."""
        total = self.num_blocks * self.block_size
        return self.num_wasted_slots / total if total else 0.0


@runtime_checkable
class KVAllocator(Protocol):
    """Bookkeeping of physical KV block ids per sequence. The runner owns the tensors.

    Every allocation is a block table: the logical block i of a sequence lives in
    physical block `block_table(seq_id)[i]`, so one attention path reads any allocator.
    """

    def allocate(self, seq_id: str, num_tokens: int) -> bool:
        """Make room for token positions [0, num_tokens) of `seq_id`.

        Returns False, changing nothing, when there is not enough free memory.
        """

    def free(self, seq_id: str) -> None:
        """Release everything `seq_id` holds; unknown ids are a no-op."""

    def block_table(self, seq_id: str) -> Seq[int]:
        """Physical block ids of `seq_id`, in logical order."""

    def stats(self) -> AllocatorStats:
        """Current usage."""


@runtime_checkable
class ForkingAllocator(Protocol):
    """Capability: sequences share blocks (fork), copy-on-write, and roll back.

    A write into a block another holder can read is preceded by a copy of that block
    into a fresh one: `allocate` performs the bookkeeping and queues (source,
    destination) block pairs, which the engine drains with `take_block_copies` and the
    runner performs, in order, before the step's forward pass.
    """

    def fork(self, parent_id: str, child_id: str) -> bool:
        """Give `child_id` (holding nothing) the KV of all of `parent_id`'s tokens.

        Returns False, changing nothing, when there is not enough free memory.
        """

    def rollback(self, seq_id: str, num_slots: int) -> None:
        """Forget the last `num_slots` token slots of `seq_id` (rejected drafts)."""

    def take_block_copies(self) -> list[tuple[int, int]]:
        """(source, destination) block copies queued since the last call, in order."""

    def ref_count(self, block_id: int) -> int:
        """How many sequences' block tables hold `block_id`."""


@runtime_checkable
class PrefixCachingAllocator(Protocol):
    """Capability: blocks of already computed token prefixes are reused.

    Only full blocks of verified tokens (prompt and accepted output, never drafts)
    are cached, so a sequence never writes into a cached block without copy-on-write.
    """

    def match_prefix(self, seq: Sequence) -> int:
        """Give `seq` (holding nothing) the cached blocks of its longest cached prefix.

        Returns the number of tokens they hold: a multiple of the block size, and
        below seq.num_tokens so at least one token is computed to yield logits. The
        scheduler sets num_computed_tokens to it; `free` undoes the match. Schedulers do
        not look up sequences whose params ask for prompt_logprobs: every prompt position
        of those must be computed to be scored.
        """

    def cache_blocks(self, seq: Sequence) -> None:
        """Make `seq`'s full blocks of computed tokens reusable by later sequences."""


@runtime_checkable
class ResettablePrefixCache(Protocol):
    """Capability (allocator contract version 2): a prefix cache that can be emptied.

    Version 1 of the allocator contract had no such member; a prefix cache written
    against it is still a PrefixCachingAllocator and keeps caching."""

    def reset_prefix_cache(self) -> None:
        """Drop every cached block no sequence holds: later lookups miss them, and they
        count as free. Blocks sequences hold stay; the prefix statistics keep counting."""


@runtime_checkable
class AnticipatingPrefixCache(Protocol):
    """Capability: a prefix cache told which waiting sequences come next, so an eviction
    policy can spare the prefixes they are about to hit."""

    def anticipate(self, seqs: Seq[Sequence]) -> None:
        """The sequences the scheduler expects to admit next, best first (replaces the
        previous ones). They hold no KV; the cache must not change them."""


# ---------------------------------------------------------------- eviction


@attrs.frozen
class EvictionCandidate:
    """What a prefix cache knows of one evictable entry: a cached block no sequence holds
    (`hash`), or the evictable tail of a leaf of the tree (`radix`, `size` blocks ending at
    `block`). Ticks are the cache's own logical clock: larger is more recent, no two
    entries share one."""

    block: int  # the id the policy names it by (radix: the deepest block of the run)
    last_access: int  # tick of the last lookup through it, insertion, or release
    inserted: int  # tick it entered the cache
    hits: int = 0  # lookups that reused it
    depth: int = 1  # blocks from the root to `block` (1: the first block of a prompt)
    size: int = 1  # blocks evicting it frees
    demand: int = 0  # waiting sequences whose cached prefix runs through it (demand-aware policies only)


@attrs.frozen
class EvictionContext:
    """What an eviction policy factory receives."""

    num_blocks: int  # blocks in the KV pool
    block_size: int


@runtime_checkable
class EvictionPolicy(Protocol):
    """Chooses which evictable prefix-cache entries go when the free list runs dry.

    `choose` gets every evictable entry (never one a sequence holds) and the number of
    blocks the pool needs, and returns the `block` ids of entries to evict, in order,
    until their sizes cover `num_blocks` (or every entry, when they cannot). The same
    candidates must give the same choice. The cache evicts them in that order, and asks
    again if that frees too little (a radix leaf's parent may have become a leaf).
    """

    def choose(self, candidates: Seq[EvictionCandidate], num_blocks: int) -> Seq[int]:
        """Block ids of `candidates` to evict, first to go first."""


@runtime_checkable
class DemandAwareEviction(Protocol):
    """An eviction policy that reads `EvictionCandidate.demand` (when `uses_demand` is
    True): the cache then counts, for each entry, the anticipated waiting sequences whose
    cached prefix runs through it (`AnticipatingPrefixCache`)."""

    uses_demand: bool


@runtime_checkable
class ContiguousAllocator(Protocol):
    """Capability: every block table is one run of consecutive physical blocks
    (table[i] == table[0] + i) for as long as its sequence holds them.

    An allocator declares it with the class attribute `contiguous_block_tables = True`.
    An attention backend that reads a sequence's K/V as one slice of the cache declares
    `requires_contiguous_block_tables = True`; the engine refuses, at start, to pair it
    with an allocator that does not declare this capability.
    """

    contiguous_block_tables: bool


# ---------------------------------------------------------------- scheduling


@attrs.frozen
class SchedulerContext:
    """What a scheduler factory receives: the allocator it must ask for room, and the
    engine limits it must never exceed."""

    allocator: KVAllocator
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    clock: Any  # callable returning seconds (time.perf_counter unless a test swaps it)
    # The KV tier below the device pool (`[kv_offload]`), or None: swap preemption
    # (`[scheduler] preemption_mode = "swap"`) moves a victim's blocks there and back.
    host_tier: Any = None


@attrs.frozen
class KVMove:
    """One whole-block move the runner performs before a step, in every layer's K and V:
    `offload` device block -> host block, `load` host block -> device block, `copy` device
    block -> device block (a copy-on-write queued before a move)."""

    kind: str  # "offload" | "load" | "copy"
    source: int
    destination: int


@runtime_checkable
class TieredRunner(Protocol):
    """A runner that holds a host KV tier beside its device cache and performs `KVMove`s."""

    def attach_host_tier(self, num_host_blocks: int, path: str | None) -> None:
        """Allocate the host tier's K/V (`num_host_blocks` blocks; memory-mapped from the
        file `path` when given)."""

    def move_blocks(self, moves: Seq["KVMove"]) -> None:
        """Perform `moves`, in order."""


@attrs.frozen
class TierStats:
    """The KV tiers' occupancy and traffic (StepReport.tier_stats, /metrics, the bench).

    Host blocks: num_host_free + num_host_cached + num_host_swapped == num_host_blocks."""

    num_host_blocks: int
    num_host_free: int
    num_host_cached: int  # prefix blocks a device prefix cache evicted, kept for reuse
    num_host_swapped: int  # blocks of sequences preempted by swap
    block_bytes: int  # bytes of one block (K and V, every layer)
    num_offloads: int = 0  # device -> host block moves, in total
    num_loads: int = 0  # host -> device block moves, in total
    num_swap_outs: int = 0  # sequences swapped out, in total
    num_swap_ins: int = 0
    host_hit_blocks: int = 0  # prefix blocks found in the host tier and brought back
    num_host_evictions: int = 0  # host blocks dropped to make room
    moves_last_step: int = 0  # block moves in the last step's plan
    bytes_last_step: int = 0

    @property
    def num_host_used(self) -> int:
        return self.num_host_cached + self.num_host_swapped

    @property
    def bytes_moved(self) -> int:
        return (self.num_offloads + self.num_loads) * self.block_bytes


@attrs.frozen
class StepPlan:
    """One step's work: how many new tokens each scheduled sequence processes.

    A prompt (or prompt chunk), one decode token and a recompute after preemption all
    have this same shape; there are no phases.
    """

    # Sequences to run, in batch order, with the number of their not-yet-computed
    # tokens this step processes (each >= 1; room for them is already allocated).
    scheduled: tuple[tuple[Sequence, int], ...]
    # Sequences preempted by recompute this step (their blocks were freed).
    preempted: tuple[Sequence, ...] = ()
    # Copy-on-write: KV blocks (source, destination) to copy before anything writes this
    # step. Schedulers leave it empty; the engine fills it from a ForkingAllocator.
    block_copies: tuple[tuple[int, int], ...] = ()
    # Moves between the device pool and the host tier (`KVMove`), performed in order before
    # `block_copies` (copies queued before a move are among them, as `copy` moves).
    # Schedulers leave it empty; the engine fills it from the host tier.
    kv_moves: tuple["KVMove", ...] = ()
    # Token trees of drafts (servelab.token_tree): (row of `scheduled`, parents of the draft
    # nodes scheduled with it) for each sequence whose scheduled drafts branch; the runner
    # lays their nodes out as query rows under a tree mask. Schedulers leave it empty; the
    # engine fills it from the drafter's proposals. A sequence absent here verifies a chain.
    draft_trees: tuple[tuple[int, tuple[int, ...]], ...] = ()

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(map(itemgetter(1), self.scheduled))

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@attrs.frozen
class SchedulerStats:
    """The same numbers from every scheduler.

    A *slot* is one of the max_num_seqs places in the batch. A slot is held by a
    running sequence, and by a finished member of a static batch until its batch ends.
    Each step, a held slot is *used* when its sequence is scheduled and *idle* (wasted)
    otherwise: slot_steps_used + slot_steps_wasted counts every slot held at every step.
    """

    num_waiting: int  # queued sequences, not running: new, or preempted and waiting to resume
    num_running: int  # unfinished sequences holding a slot
    num_preemptions: int  # total since start
    # Computed tokens whose KV a recompute preemption threw away, since start: each is
    # computed again on resume unless a prefix-cache hit serves it.
    num_discarded_tokens: int = 0
    num_scheduled_seqs: int = 0  # sequences the last schedule() planned
    num_scheduled_tokens: int = 0  # tokens the last schedule() planned
    num_idle_slots: int = 0  # slots held but not scheduled in the last planned step
    slot_steps_used: int = 0  # num_scheduled_seqs summed over every step since start
    slot_steps_wasted: int = 0  # num_idle_slots summed over every step since start
    num_steps: int = 0  # non-empty plans since start


@runtime_checkable
class Scheduler(Protocol):
    """Decides every step who runs and how many tokens each processes."""

    def add(self, seq: Sequence) -> None:
        """Queue a new request."""

    def abort(self, request_id: str) -> Sequence | None:
        """Drop a request wherever it is and free its KV; returns it, or None."""

    def schedule(self) -> StepPlan:
        """Plan the next step; allocates KV for every scheduled token."""

    def finish(self, seqs: Seq[Sequence]) -> None:
        """Retire sequences the engine marked finished and free their KV."""

    def has_unfinished(self) -> bool:
        """True while any request is waiting or running."""

    def stats(self) -> SchedulerStats:
        """Current queue lengths and counters."""


@runtime_checkable
class ForkingScheduler(Protocol):
    """Capability: parallel sampling (SamplingParams.n > 1) by forking a sequence."""

    def fork(self, parent: Sequence, children: Seq[Sequence]) -> None:
        """Run `children` alongside `parent`, whose prompt they share, from the next step.

        Called after the step that sampled every sequence's first token. Each child
        gets the parent's KV through the allocator's fork; a child that cannot (no
        memory) queues to recompute its prompt instead.
        """


# ---------------------------------------------------------------- drafting


@attrs.frozen
class TargetModel:
    """What a drafter may read of the target model: its output head, for drafters that
    predict from the target's hidden states (Medusa)."""

    hidden_size: int
    vocab_size: int
    # Final-normed hidden states [N, hidden_size] -> float32 logits [N, vocab] (the LM head).
    lm_head: Callable[["torch.Tensor"], "torch.Tensor"]
    path: str | None = None  # the checkpoint directory, when there is one
    dtype: Any = None  # torch.dtype the target runs in
    device: Any = None  # torch.device
    # Token ids [N] -> input embeddings [N, hidden_size] (an EAGLE-style drafter's input); None where not offered.
    embed: Callable[["torch.Tensor"], "torch.Tensor"] | None = None
    num_layers: int = 0  # decoder layers (0: unknown); FeatureDrafter.feature_layers index them


@runtime_checkable
class ModelRunnerLike(Protocol):
    """A loaded model with its own KV cache (see DrafterContext.load_model)."""

    vocab_size: int
    device: Any  # torch.device of its logits

    def prepare(self, plan: "StepPlan", allocator: KVAllocator) -> Any:
        """Input tensors for `plan`, slots taken from `allocator`'s block tables."""

    def execute(self, inputs: Any) -> "torch.Tensor":
        """float32 logits [S, vocab], one row per position whose next token is wanted
        (the last scheduled token of each sequence, and every draft position)."""


@attrs.frozen
class DrafterContext:
    """What a drafter factory receives."""

    vocab_size: int
    max_model_len: int
    max_num_seqs: int = 256
    block_size: int = 16
    num_kv_blocks: int = 0  # blocks in the target's KV pool (a draft model's pool may match it)
    seed: int = 0  # the engine's seed, for drafters that sample
    target: TargetModel | None = None  # None where the engine has no real model (simulator, tests)
    # load_model(spec, num_blocks) -> ModelRunnerLike: a checkpoint (path or builtin:<name>)
    # loaded in the engine's dtype and device, with a KV cache of num_blocks blocks and the
    # engine's attention backend. None where models cannot be loaded.
    load_model: Callable[[str, int], ModelRunnerLike] | None = None
    # filtered_probs(logits [N, vocab], params per row) -> probabilities after temperature,
    # top-k, top-p and min-p, exactly as the verifier filters the target's p. A drafter
    # that samples draws from these and returns them as Draft.probs (q).
    filtered_probs: Callable[["torch.Tensor", Seq[Any]], "torch.Tensor"] | None = None


@attrs.frozen
class Draft:
    """Proposed tokens for one sequence, with the distributions they were drawn from.

    `probs` [len(token_ids), vocab] holds q, the drafter's (filtered) distribution at each
    draft position, the token having been sampled from it; None means the tokens were
    chosen deterministically (q is one-hot), as lookup and top-1 drafters do. A drafter
    may also return a plain sequence of ints for a deterministic draft.

    `parents` (drafter contract version 3) makes the draft a token tree: parents[i] is -1
    for a child of the sequence's last token, else the index of an earlier node
    (servelab.token_tree); None is a chain. Only a drafter that declares
    `TreeDrafter.proposes_trees` may branch. For a tree, probs[i] is the distribution node
    i was drawn from given its parent's path and its earlier siblings (the same q for
    siblings drawn independently; q with the earlier siblings removed and renormalised for
    siblings drawn without replacement); None: deterministic, distinct siblings.
    """

    token_ids: Seq[int]
    probs: "torch.Tensor | None" = None
    parents: Seq[int] | None = None

    def __iter__(self):
        return iter(self.token_ids)

    def __len__(self) -> int:
        return len(self.token_ids)


@runtime_checkable
class Drafter(Protocol):
    """Proposes up to k tokens per decoding sequence for lossless verification.

    The engine asks before each step for every running sequence that is decoding, then
    verifies the drafts in that step's target pass; drafts a sequence cannot use (past
    max_tokens or max_model_len, or beyond the token budget) are cut. A drafter that reads
    the target's hidden states sets `needs_hidden_states = True`: `propose` then also
    gets `hidden_states` [len(seqs), hidden] — row i the final-normed hidden state of the
    target at the position that produced seq i's last token. A drafter keeping per-sequence
    state may define `release(request_id)`, called when a sequence finishes or is
    preempted. A drafter declaring `TreeDrafter.proposes_trees` may return token trees
    (`Draft.parents`): k then bounds a tree's depth.
    """

    def propose(self, seqs: Seq[Sequence]) -> Mapping[str, "Draft | Seq[int]"]:
        """Drafts per request id (possibly empty)."""


# ---------------------------------------------------------------- attention


@attrs.frozen
class AttentionContext:
    """Model and cache geometry an attention backend is built for."""

    num_heads: int  # under tensor parallelism: this rank's query heads
    num_kv_heads: int  # and this rank's KV heads
    head_dim: int
    block_size: int
    num_blocks: int  # blocks in each layer's cache
    dtype: Any  # torch.dtype
    device: Any  # torch.device
    # `[engine] kv_cache_dtype`: "auto" (K/V in `dtype`) or a quantized cache ("int8",
    # "fp8_e4m3", "fp8_e5m2"; rows laid out by servelab.interfaces.kv_row_elements), which
    # only a QuantizedKVBackend that lists it in supported_kv_cache_dtypes is built for.
    kv_cache_dtype: str = "auto"


@attrs.frozen
class AttentionMetadata:
    """One step's batch layout, built once per step and shared by every layer.

    T = total scheduled tokens, B = scheduled sequences, M = max blocks per sequence.
    Tokens of sequence b are rows query_start_loc[b]:query_start_loc[b+1] of the
    flattened batch; they sit at the last query_lens[b] positions of its context.
    """

    query_start_loc: "torch.Tensor"  # [B + 1] int64, prefix sums of query_lens
    query_lens: "torch.Tensor"  # [B] int64, new tokens per sequence
    context_lens: "torch.Tensor"  # [B] int64, tokens in cache after this step's writes
    block_tables: "torch.Tensor"  # [B, M] int64, padded with 0 past each table's end
    slot_mapping: "torch.Tensor"  # [T] int64, cache slot (block * block_size + offset) per token
    max_query_len: int
    max_context_len: int
    query_lens_list: tuple[int, ...]  # the same as query_lens, on the host
    context_lens_list: tuple[int, ...]
    # Per sequence, None (causal) or the parents of its query rows (row 0: -1; row r > 0: an
    # earlier row): a token tree, attended under the tree mask by a TreeAttentionBackend.
    # None for the whole step when no sequence has one.
    tree_parents: tuple[tuple[int, ...] | None, ...] | None = None


@runtime_checkable
class AttentionBackend(Protocol):
    """Writes a step's new K/V into the paged cache and attends over it.

    The backend chooses the cache layout (the runner allocates one key and one value
    tensor per layer of `kv_cache_shape()`); allocator block ids index its block dimension.
    """

    def kv_cache_shape(self) -> tuple[int, ...]:
        """Shape of one layer's key (and value) cache holding context.num_blocks blocks."""

    def kv_cache_block_dim(self) -> int:
        """The dimension of kv_cache_shape() that allocator block ids index (block copies use it)."""

    def prepare(self, metadata: AttentionMetadata) -> Any:
        """Per-step precomputation shared by every layer (gather indices, masks)."""

    def forward(
        self,
        query: "torch.Tensor",  # [T, num_heads, head_dim]
        key: "torch.Tensor",  # [T, num_kv_heads, head_dim]
        value: "torch.Tensor",  # [T, num_kv_heads, head_dim]
        key_cache: "torch.Tensor",  # kv_cache_shape()
        value_cache: "torch.Tensor",  # kv_cache_shape()
        prepared: Any,  # what prepare() returned for this step
        scale: float,
    ) -> "torch.Tensor":  # [T, num_heads, head_dim]
        """Store key/value at the step's slots, then attend causally for every query."""


# ---------------------------------------------------------------- routing


ROOT_BLOCK_HASH = 0x5E4E1AB  # the parent of block 0 (a constant: str hashes vary per process)


def chained_block_hash(parent_hash: int, tokens: tuple[int, ...]) -> int:
    """The name of a KV block holding `tokens` right after the prefix named `parent_hash`
    (ROOT_BLOCK_HASH for block 0): it stands for the whole prefix the block ends, not for
    its own tokens alone. Integers and tuples of integers hash the same in every process,
    so a router and a replica in another process agree on it; the `hash` allocator names
    its cached blocks with it."""
    return hash((parent_hash, tokens))


def prefix_block_hashes(token_ids: Seq[int], block_size: int) -> list[int]:
    """Chained hashes (`chained_block_hash`) of the full blocks of `token_ids`: hash i
    covers tokens [0, (i + 1) * block_size), so two prompts share hash i exactly when they
    share those tokens."""
    hashes = []
    parent = ROOT_BLOCK_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = chained_block_hash(parent, tuple(token_ids[start:start + block_size]))
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
    block_size: int = 16  # token slots per KV block
    prefix_summary: PrefixSummary | None = None  # the replica's cached prefixes, where it reports them

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


@attrs.frozen
class RouterContext:
    """What a router factory receives: the fleet it routes over."""

    num_replicas: int  # replicas at start; ids are 0..num_replicas-1 (some may later leave)
    block_size: int = 16  # KV block size of the replicas (for prefix hashing)
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
# ---------------------------------------------------------------- logits processing


@attrs.frozen
class LogitsProcessorContext:
    """What a logits processor factory receives."""

    vocab_size: int  # logits columns (the model's vocabulary, which may exceed the tokenizer's)
    eos_token_ids: frozenset[int]
    # encode(text, add_special_tokens) / decode(ids); `.backend` is the `tokenizers.Tokenizer`.
    tokenizer: Any = None  # None when the checkpoint has none
    device: Any = None  # torch.device of the logits


@attrs.frozen
class ProcessorRequest:
    """A request (one completion) as a processor sees it when its state is created."""

    request_id: str  # the sequence id (completion i > 0 of an n > 1 request is "{id}#{i}")
    params: Any  # SamplingParams
    prompt_token_ids: tuple[int, ...]
    prepared: Any = None  # what `prepare(params)` produced, for processors that define it


@runtime_checkable
class LogitsProcessor(Protocol):
    """Changes next-token logits before sampling: penalties, biases, bans, grammars.

    One instance serves every request; what it knows about one request lives in a
    per-request *state* it creates and the engine hands back:

    - `new_state` at admission (every completion of an n > 1 request gets its own);
    - `apply` once per engine step over the rows that sample, row i with `states[i]`;
      a row's result must not depend on the other rows;
    - `accept` with each token appended to the request, in order;
    - `rollback(state, k)` forgets the last k accepted tokens exactly (speculative
      decoding accepts drafts tentatively to score the positions after them);
    - `release` once the request finished, was aborted or failed (optional).

    A request uses the processor when it names it in `SamplingParams.logits_processors`,
    when the engine config lists it under `[logits_processors] default`, or when
    `is_requested(params)` says its SamplingParams ask for it (how the built-ins are
    selected; optional, like the two below). `validate(params)` raises RequestError for a request
    it cannot serve (checked before the request is queued); `prepare(params)` returns a
    concurrent.futures.Future whose result becomes ProcessorRequest.prepared: the
    request waits for it, other requests keep running (the grammar compiler uses it).
    A processor that raises fails the requests whose rows it was processing, alone.
    """

    def new_state(self, request: ProcessorRequest) -> Any:
        """The state of a newly admitted request."""

    def apply(self, logits: "torch.Tensor", states: Seq[Any]) -> "torch.Tensor":
        """Processed logits [R, vocab] float32 for rows [R, vocab] (may modify `logits` in place)."""

    def accept(self, state: Any, token_id: int) -> None:
        """`token_id` was appended to the request."""

    def rollback(self, state: Any, num_tokens: int) -> None:
        """Forget the last `num_tokens` accepted tokens."""


# ---------------------------------------------------------------- optional capabilities
# Every optional member the engine, the model or a wing relies on is declared here, so a
# plugin author can see the whole contract. Each is found with isinstance (a
# runtime-checkable Protocol): a member that is absent is a capability the plugin lacks.


@runtime_checkable
class ValidatingProcessor(Protocol):
    """A logits processor that refuses some requests before they are queued."""

    def validate(self, params: Any) -> None:
        """Raise RequestError naming what this processor cannot serve."""


@runtime_checkable
class PreparingProcessor(Protocol):
    """A logits processor that prepares something per request off the step loop."""

    def prepare(self, params: Any) -> Any:
        """A concurrent.futures.Future whose result becomes ProcessorRequest.prepared, or None."""


@runtime_checkable
class SelfSelectingProcessor(Protocol):
    """A logits processor that SamplingParams fields select (the built-ins)."""

    def is_requested(self, params: Any) -> bool:
        """True when `params` ask for this processor."""


@runtime_checkable
class ReleasingProcessor(Protocol):
    """A logits processor whose states hold something to let go of."""

    def release(self, state: Any) -> None:
        """The request finished, was aborted or failed."""


@runtime_checkable
class WarmingProcessor(Protocol):
    """A logits processor with slow one-time set-up (an import, a first compilation) that a
    server runs on a thread of its own at start, before the first request needs it."""

    def warm_up(self) -> None: ...


@runtime_checkable
class ClosingProcessor(Protocol):
    """A logits processor holding something that outlives a request (a compiler process)."""

    def close(self) -> None:
        """The engine is stopping: end it now, without waiting for work in progress."""


@runtime_checkable
class ReleasingDrafter(Protocol):
    """A drafter keeping per-sequence state."""

    def release(self, request_id: str) -> None:
        """The sequence finished, was aborted or preempted."""


@runtime_checkable
class AcceptingDrafter(Protocol):
    """A drafter told which of its drafts were accepted (to adapt, or to learn)."""

    def accepted(self, request_id: str, token_ids: Seq[int]) -> None:
        """After verification: the draft tokens of `request_id` the target accepted this
        step, in order (empty when it rejected the first); called once per verified draft."""


@runtime_checkable
class FinishAwareDrafter(Protocol):
    """A drafter that learns from finished sequences (suffix decoding's cache of outputs)."""

    def finished(self, seq: Sequence) -> None:
        """`seq` finished (stop, length, abort or error) and is about to be released: its
        prompt and output are final. Sequences that never finished (a request discarded
        before admission) are released without this call."""


@runtime_checkable
class TreeDrafter(Protocol):
    """A drafter that proposes token trees (`Draft.parents`) when `proposes_trees` is True
    (drafter contract version 3). The engine refuses it at start unless the attention
    backend is a TreeAttentionBackend and the runner a SlotMovingRunner."""

    proposes_trees: bool


@runtime_checkable
class HiddenStateDrafter(Protocol):
    """A drafter that reads the target's hidden states (when `needs_hidden_states` is True)."""

    needs_hidden_states: bool

    def propose(self, seqs: Seq[Sequence], hidden_states: "torch.Tensor") -> Mapping[str, "Draft | Seq[int]"]:
        """Drafts per request id; hidden_states[i] is behind seqs[i]'s last token."""


@runtime_checkable
class FeatureDrafter(Protocol):
    """A drafter that reads the target's intermediate features at every computed position
    (EAGLE-style): the residual stream after each decoder layer in `feature_layers`. After
    each step, for every sequence whose computed tokens grew, the engine calls `observe`
    with the features of its newly verified positions (prompt chunks, the last token and
    accepted drafts; rejected drafts' rows are left out). The engine refuses it at start
    unless the runner is a FeatureRunner."""

    feature_layers: tuple[int, ...]

    def observe(self, request_id: str, start: int, features: "torch.Tensor", next_token_ids: Seq[int]) -> None:
        """features [n, len(feature_layers) * hidden] of positions start .. start + n - 1;
        next_token_ids[i] is the token at position start + i + 1 (the one position
        start + i predicted, now verified). `start` may be below what an earlier call
        reached (the sequence was recomputed after a preemption): positions from `start`
        on replace what was observed there. It may lie above it, where a prefix cache
        served earlier positions without computing them."""


@runtime_checkable
class FeatureRunner(Protocol):
    """A runner that returns the residual stream of chosen decoder layers at every row."""

    def execute_with_features(self, inputs: Any, layers: tuple[int, ...]) -> "tuple[torch.Tensor, torch.Tensor]":
        """Logits as `execute`, and features [T, len(layers) * hidden] in input-row order."""

    def embed(self, token_ids: "torch.Tensor") -> "torch.Tensor":
        """The target's input embeddings of token_ids [N]: [N, hidden], in its dtype."""


@runtime_checkable
class ContiguousBlockTablesBackend(Protocol):
    """An attention backend that reads each sequence's K/V as one contiguous run of blocks
    (when `requires_contiguous_block_tables` is True): only a ContiguousAllocator serves it."""

    requires_contiguous_block_tables: bool


@runtime_checkable
class TreeAttentionBackend(Protocol):
    """An attention backend that attends token trees (when `supports_tree_attention` is
    True): for a sequence whose `AttentionMetadata.tree_parents` entry is set, query row r
    sees the context before the sequence's first query row and the query rows on its own
    root path only, not causally every earlier row (servelab.token_tree.ancestor_mask)."""

    supports_tree_attention: bool


@runtime_checkable
class QuantizedKVBackend(Protocol):
    """An attention backend that can store K/V quantized (`[engine] kv_cache_dtype`).

    Each (token, KV head) row of a quantized cache is `kv_row_elements(head_dim, kv_cache_dtype)`
    one-byte elements: the head_dim quantized values, zero padding to a multiple of 4, then
    the row's float32 scale (its bytes), so a row dequantizes as values * scale and every
    whole-block move (copy-on-write, another tier) carries the scales with the values. The
    runner allocates the cache in `kv_cache_storage_dtype()`.
    """

    supported_kv_cache_dtypes: frozenset[str]  # the quantized kv_cache_dtypes it reads and writes

    def kv_cache_storage_dtype(self) -> Any:
        """The torch dtype of the cache tensors: the model's for "auto", else the element's."""


@runtime_checkable
class LayerOpsBackend(Protocol):
    """An attention backend offering the model fused element-wise ops (servelab.model.llama.LayerOps),
    or None while they are not ready."""

    @property
    def layer_ops(self) -> Any: ...


@runtime_checkable
class NativeDecoderBackend(Protocol):
    """An attention backend that can run the whole decoder of a step in one native call."""

    def decoder_forward(self, model: Any, input_ids: "torch.Tensor", positions: "torch.Tensor", kv_caches: Any,
                        prepared: Any, logits_indices: "torch.Tensor") -> "torch.Tensor | None":
        """The final-normed hidden states of the wanted rows, or None to decline this step."""


@runtime_checkable
class PanelKernelsBackend(Protocol):
    """An attention backend whose library has a matmul the model's packed linears may move
    to (servelab.model.packed_linear.use_panel_linears), or None while it is not ready."""

    @property
    def panel_kernels(self) -> Any: ...


@runtime_checkable
class QuantKernelsBackend(Protocol):
    """An attention backend whose library has a matmul on quantized weight blocks that the
    model's quantized linears take (servelab.model.quantized_linear), or None while it is
    not ready."""

    @property
    def quant_kernels(self) -> Any: ...


@runtime_checkable
class QuantizedLinearLayer(Protocol):
    """A linear layer holding its weight as quantized blocks
    (servelab.model.quantized_linear.QuantizedLinear), as a native decoder reads it."""

    blocks: "torch.Tensor"  # uint8 [out_features, bytes a row] of GGML blocks
    bias32: "torch.Tensor | None"
    format_id: int  # the block format, as the library's quant_linear takes it
    out_features: int
    kernels: Any  # the library whose kernel it was handed, or None (the torch path)


@runtime_checkable
class FinishAwareRouter(Protocol):
    """A router that keeps its own view of what it routed where."""

    def request_finished(self, request_id: str, replica_id: int) -> None:
        """A request it routed finished, failed or was aborted (called once)."""


# ---------------------------------------------------------------- the model runner


def sampling_rows(plan: StepPlan) -> tuple[list[int], list[int]]:
    """Which rows of `plan.scheduled` sample this step, and how many logits rows each
    needs: a sequence samples once its scheduled tokens reach its last verified token,
    with one row for that token and one per draft scheduled after it."""
    past_end = [seq.num_computed_tokens + num_new - len(seq.prompt_token_ids) - len(seq.output_token_ids)
                for seq, num_new in plan.scheduled]
    rows = [row for row, past in enumerate(past_end) if past >= 0]
    return rows, [past_end[row] + 1 for row in rows]


@runtime_checkable
class StepInputs(Protocol):
    """What the engine reads of the inputs a runner prepared for a step."""

    sampled_seq_rows: list[int]  # sampling_rows(plan)[0]
    num_logits_rows: list[int]  # sampling_rows(plan)[1]
    # (plan row, first prompt position, count) of the prompt positions whose logits follow
    # the sampling rows (prompt logprobs); () when none were asked for.
    prompt_logits: tuple[tuple[int, int, int], ...]


@runtime_checkable
class Runner(Protocol):
    """What the engine needs of a model runner: the single-process one, the tensor-parallel
    one and the simulator's all state it."""

    device: Any  # torch.device of the logits
    supports_prompt_logprobs: bool  # prepare(..., prompt_logprobs=True) adds prompt positions' rows

    @property
    def vocab_size(self) -> int: ...

    def prepare(self, plan: StepPlan, allocator: KVAllocator, prompt_logprobs: bool = False) -> StepInputs:
        """The step's inputs, slots taken from `allocator`'s block tables."""

    def execute(self, inputs: Any) -> "torch.Tensor":
        """float32 logits [sum(inputs.num_logits_rows) (+ prompt rows), vocab]."""

    def execute_with_hidden(self, inputs: Any) -> "tuple[torch.Tensor, torch.Tensor]":
        """The logits and the final-normed hidden states [rows, hidden] they came from."""

    def copy_blocks(self, copies: Seq[tuple[int, int]]) -> None:
        """Copy whole KV blocks (source, destination), in order (copy-on-write)."""

    # A runner that can hold a host tier also states TieredRunner (attach_host_tier, move_blocks).

    def close(self) -> None:
        """Release what outlives the step loop (other ranks); idempotent."""


@runtime_checkable
class SlotMovingRunner(Protocol):
    """A runner that copies single KV slots (token positions) in every layer's K and V:
    the engine moves the accepted root path of a verified token tree into place."""

    def move_slots(self, moves: Seq[tuple[int, int]]) -> None:
        """Copy slot `source` to slot `destination` (block * block_size + offset) for each
        (source, destination), every source read before any destination is written."""


@runtime_checkable
class LMHeadRunner(Protocol):
    """A runner whose model has an output head drafters may use (servelab.interfaces.TargetModel)."""

    def lm_head(self, hidden: "torch.Tensor") -> "torch.Tensor":
        """float32 logits of final-normed hidden states."""

"""The drafter contract (kind `drafters`, `[drafter]`): what a drafter factory receives
(`DrafterContext`, the `TargetModel` it may read), the `Draft` it returns, the Protocol
and its optional capabilities, and the token-tree helpers a tree drafter uses. Changes by
version: docs/contract-versions.md ("drafters").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, Sequence as Seq, runtime_checkable

import attrs

from servelab.contracts.allocator import KVAllocator
from servelab.contracts.scheduler import StepPlan
from servelab.defaults import BLOCK_SIZE, MAX_NUM_SEQS
from servelab.sequence import Sequence, SequenceStatus
from servelab.token_tree import ancestor_mask, query_parents, tree_error

if TYPE_CHECKING:  # torch stays out of imports that plugin discovery triggers
    import torch

__all__ = [
    "Sequence",
    "SequenceStatus",
    "ancestor_mask",
    "query_parents",
    "tree_error",
    "TargetModel",
    "ModelRunnerLike",
    "DrafterContext",
    "Draft",
    "Drafter",
    "ReleasingDrafter",
    "AcceptingDrafter",
    "FinishAwareDrafter",
    "TreeDrafter",
    "HiddenStateDrafter",
    "FeatureDrafter",
]


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
    max_num_seqs: int = MAX_NUM_SEQS
    block_size: int = BLOCK_SIZE
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

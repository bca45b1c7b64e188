"""One request in the engine: everything it owns from intake to release, on one record.

A request is n sequences (SamplingParams.n; completion 0 is the request's own, the
others are forked from it once its prompt is computed), its sampling recipe (decided at
intake: which of the sampling stage's paths its rows take), and per sequence its random
generator (seeded requests), its text (stop strings), its logits processors' states and
its speculation state (`Drafting`); plus what the request waits for before it is queued
(processor preparation, such as grammar compilation). `release()` lets go of all of it.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Callable, Collection, Iterator

import attrs

from servelab.detokenize import IncrementalText
from servelab.errors import RequestError
from servelab.interfaces import Sequence, SequenceStatus
from servelab.sampling_params import SamplingParams
from servelab.sampling_recipe import SamplingRecipe
from servelab.sequence import owner_of, sequence_id


@attrs.frozen
class RequestSpec:
    """What a caller asks for: one prompt (text or token ids) and how to sample it."""

    prompt: str | list[int]
    params: SamplingParams | None = None
    request_id: str | None = None
    priority: int = 0
    arrival_time: float | None = None  # on the engine's clock; None: now
    lora_request: Any = None  # servelab.LoRARequest: the LoRA adapter it runs with; None: the base model
    # The last tokens of `prompt` that another engine generated for this request (a prefill
    # replica's first token, servelab.disagg): they start the sequence's output, as if this
    # engine had generated them. They count in max_tokens and min_tokens, penalties see them,
    # every logits processor accepts them (a grammar advances over them), stop strings are
    # matched over their text and the new tokens', and the output's token ids and text
    # include them (their logprobs positions are None: the other engine scored them). One
    # completion (n=1) and no prompt_logprobs: the engine that saw the prompt scored it.
    continues: tuple[int, ...] = ()


@attrs.define
class Drafting:
    """One sequence's speculation state, written by the propose and verify stages."""

    probs: Any = None  # this step's draft distributions [k, vocab] (a drafter that gives them), or None
    parents: list[int] | None = None  # this step's draft tree, when it branches (servelab.token_tree)
    hidden: Any = None  # the target's hidden state behind its last token (HiddenStateDrafter)
    path: list[int] | None = None  # the tree path accepted this step (FeatureDrafter)


@attrs.define(eq=False)
class Request:
    request_id: str
    prompt: str | None  # the prompt's text, when it came as text
    params: SamplingParams
    recipe: SamplingRecipe
    sequences: list[Sequence]  # by completion index
    generators: list[Any]  # per sequence: its torch.Generator, or None (the engine's default)
    texts: list[IncrementalText | None]  # per sequence, when it has stop strings
    processor_states: list[dict[str, Any]]  # per sequence: processor name -> state
    drafts: list[Drafting] = attrs.field()  # per sequence
    preparing: dict[str, Future] = attrs.field(factory=dict)  # processor name -> its preparation
    released: bool = False

    @drafts.default
    def _no_drafts(self) -> list[Drafting]:
        return [Drafting() for _ in self.sequences]

    @property
    def first(self) -> Sequence:
        return self.sequences[0]

    @property
    def is_finished(self) -> bool:
        return all(seq.finish_reason is not None for seq in self.sequences)

    def fail(self, error: str, now: float) -> None:
        """Every sequence ends with finish_reason "error"."""
        for seq in self.sequences:
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason, seq.error, seq.finish_time = "error", error, now

    def release(self, release_sequence: Callable[[Sequence, dict[str, Any]], None]) -> None:
        """Let go of what each sequence holds outside this record (drafter and processor
        states, through `release_sequence`) and of the rest; idempotent."""
        if self.released:
            return
        self.released = True
        self.preparing = {}  # other prompts of the same request may share these: not cancelled here
        for seq, states in zip(self.sequences, self.processor_states):
            release_sequence(seq, states)
        self.generators = [None] * len(self.sequences)
        self.texts = [None] * len(self.sequences)
        self.processor_states = [{} for _ in self.sequences]
        self.drafts = [Drafting() for _ in self.sequences]


def request_id_of(seq: Sequence) -> str:
    """The id of the request a sequence belongs to (completion i > 0 is "{request_id}#{i}")."""
    return seq.request_id if seq.completion_index == 0 else owner_of(seq.request_id)


class RequestTable:
    """The engine's requests in flight, by request id."""

    def __init__(self) -> None:
        self._requests: dict[str, Request] = {}
        self._by_sequence: dict[str, Request] = {}  # every sequence id of every request
        self._preparing: dict[str, Request] = {}  # those waiting for a processor's preparation
        self._special: set[str] = set()  # those whose recipe is not plain
        # No request in flight needs more than the plain sampling path (SamplingRecipe.plain).
        self.all_plain = True

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._requests.values()))

    def get(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def of(self, seq: Sequence) -> Request:
        return self._by_sequence[seq.request_id]

    def holds(self, seq: Sequence) -> bool:
        """Whether this very sequence object belongs to a request in flight."""
        request = self._by_sequence.get(seq.request_id)
        if request is None:
            return False
        sequences = request.sequences
        return sequences[0] is seq or any(s is seq for s in sequences)

    def add(self, request: Request) -> None:
        self._requests[request.request_id] = request
        for seq in request.sequences:
            self._by_sequence[seq.request_id] = request
        if request.preparing:
            self._preparing[request.request_id] = request
        if not request.recipe.plain:
            self._special.add(request.request_id)
            self.all_plain = False

    def remove(self, request: Request) -> None:
        if self._requests.pop(request.request_id, None) is not None:
            for seq in request.sequences:
                self._by_sequence.pop(seq.request_id, None)
        self._preparing.pop(request.request_id, None)
        self._special.discard(request.request_id)
        self.all_plain = not self._special

    def prepared_now(self) -> list[Request]:
        """The requests whose preparations have all finished; they stop counting as preparing."""
        done = [r for r in self._preparing.values() if all(f.done() for f in r.preparing.values())]
        for request in done:
            del self._preparing[request.request_id]
        return done

    def check_free(self, request_id: str, n: int, taken: Collection[str] = ()) -> None:
        """RequestError unless a request `request_id` with n sequences clashes with none in
        flight (a sequence id of completion i > 0 is "{request_id}#{i}") or in `taken`."""
        owner, _, index = request_id.rpartition("#")
        clash = (request_id in self._requests or request_id in taken
                 or any(sequence_id(request_id, i) in self._requests for i in range(1, n))
                 or (index.isdecimal() and len(index) < 10 and owner in self._requests
                     and int(index) < len(self._requests[owner].sequences)))
        if clash:
            raise RequestError(f"request id {request_id!r} is already in flight")

    def sequences(self) -> Iterator[Sequence]:
        for request in self._requests.values():
            yield from request.sequences

    def preparing(self) -> list[Request]:
        return list(self._preparing.values())

    def has_preparing(self) -> bool:
        return bool(self._preparing)

    def num_preparing(self) -> int:
        return len(self._preparing)

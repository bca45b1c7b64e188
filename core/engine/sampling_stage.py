"""The sampling stage: a step's logits become new tokens.

Rows arrive as the runner laid them out (`servelab.interfaces.sampling_rows`): one row per
sampling sequence, or 1 + k rows for a sequence verifying k drafts (the verify stage's),
then the prompt positions scored for prompt logprobs. Each request's recipe
(servelab.sampling_recipe, decided at intake) says which of these it needs:

1. a batch of plain requests, one row each: one `sample` call, nothing else;
2. otherwise prompt logprobs are read off the prompt rows (which are then dropped), and
   the rows of one token each are sampled: a request with n > 1 whose prompt was just
   computed samples all n first tokens from its one row (its n - 1 children are forked
   after the step); rows with logits work are processed (penalties, bias, bans, the
   grammar mask) and their logprobs read; then every row is sampled in one call.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable

import attrs
import torch

from servelab.interfaces import SamplingKernelsBackend, Sequence
from servelab.logits_pipeline import LogitsPipeline
from servelab.logprobs import position_logprobs
from servelab.outputs import RequestEvent
from servelab.request import Request, RequestTable
from servelab.run_stage import StepRun
from servelab.sampler import sample


@attrs.define
class SampledRows:
    """The step's sampling sequences and where their logits rows start (the verify stage
    reads the sequences with more than one row)."""

    seqs: list[Sequence]
    owners: list[Request] | None  # their requests (None on the plain path, which needs none)
    first_rows: list[int]
    num_rows: list[int]


@attrs.define
class Sampled:
    """What the sampling and verify stages decided for a step."""

    rows: SampledRows
    # per sequence: its new tokens (accepted drafts + one), the update stage cuts them at its stop
    events: dict[Sequence, RequestEvent] = attrs.field(factory=dict)
    forks: list[tuple[Sequence, list[Sequence]]] = attrs.field(factory=list)  # n > 1: (parent, children) to fork
    failures: dict[str, str] = attrs.field(factory=dict)  # by sequence id: a logits processor failed it (no token)
    scored_prompts: dict[str, list] = attrs.field(factory=dict)  # by request id: prompt logprobs completed
    num_drafts: dict[str, int] = attrs.field(factory=dict)  # by sequence id: drafts verified
    num_accepted: dict[str, int] = attrs.field(factory=dict)  # by sequence id: of which accepted
    paths: dict[str, tuple[int, ...]] = attrs.field(factory=dict)  # by sequence id: a token tree's accepted nodes


class SamplingStage:
    def __init__(self, requests: RequestTable, pipeline: LogitsPipeline, default_generator: torch.Generator,
                 raw_logprobs: bool, kernels: Callable[[], Any] = lambda: None) -> None:
        self.requests = requests
        self.pipeline = pipeline
        self.default_generator = default_generator
        self.raw_logprobs = raw_logprobs  # logprobs of the model's logits, before any processor
        self.kernels = kernels  # the backend's sampling kernels now (SamplingKernelsBackend), or None

    def sample(self, run: StepRun) -> Sampled:
        inputs, logits = run.inputs, run.logits
        seqs = [run.plan.scheduled[row][0] for row in inputs.sampled_seq_rows]
        num_rows = inputs.num_logits_rows
        one_row_each = num_rows.count(1) == len(num_rows)
        if self.requests.all_plain and one_row_each:
            token_ids = sample(logits, [s.params for s in seqs], [None] * len(seqs), self.default_generator,
                               self.kernels())
            return Sampled(SampledRows(seqs, None, list(range(len(seqs))), num_rows),
                           {seq: RequestEvent((token_id,)) for seq, token_id in zip(seqs, token_ids)})
        owners = [self.requests.of(seq) for seq in seqs]
        first_rows = list(range(len(seqs))) if one_row_each else list(itertools.accumulate(num_rows[:-1], initial=0))
        out = Sampled(SampledRows(seqs, owners, first_rows, num_rows))
        if inputs.prompt_logits or any(r.recipe.scores_prompt for r in owners):
            logits = self._score_prompts(run, seqs, owners, out)
        plain = [i for i, n in enumerate(num_rows) if n == 1]
        if plain:
            self._sample_rows(logits if one_row_each else logits[torch.tensor(
                [first_rows[i] for i in plain], dtype=torch.int64, device=logits.device)],
                [seqs[i] for i in plain], [owners[i] for i in plain], out)
        return out

    def _sample_rows(self, logits: torch.Tensor, seqs: list[Sequence], owners: list[Request], out: Sampled) -> None:
        """Rows of one token each: forks expanded, logits work done, then all sampled at once."""
        if any(r.recipe.forks and not s.output_token_ids for s, r in zip(seqs, owners)):
            rows: list[int] = []
            members_of: list[tuple[list[Sequence], Request]] = []
            for row, (seq, request) in enumerate(zip(seqs, owners)):
                members = [seq]
                if request.recipe.forks and not seq.output_token_ids:  # its prompt was just computed
                    children = request.sequences[1:]
                    for child in children:
                        child.first_scheduled_time = seq.first_scheduled_time
                    members += children
                    out.forks.append((seq, children))
                rows.extend([row] * len(members))
                members_of.append((members, request))
            logits = logits[torch.tensor(rows, device=logits.device)]
            seqs = [seq for members, _ in members_of for seq in members]
            owners = [request for members, request in members_of for _ in members]
        generators = [r.generators[s.completion_index] for s, r in zip(seqs, owners)]
        worked = any(r.recipe.logits_work for r in owners)
        logprob_rows = [i for i, s in enumerate(seqs) if s.logprobs is not None] if worked else []
        index = torch.tensor(logprob_rows, dtype=torch.int64, device=logits.device) if logprob_rows else None
        chosen = logits[index] if index is not None and self.raw_logprobs else None  # a copy: processing is in place
        states = [r.processor_states[s.completion_index] for s, r in zip(seqs, owners)] if worked else []
        processed = [i for i, held in enumerate(states) if held]
        if processed:
            self.pipeline.apply(logits, [seqs[i] for i in processed], [states[i] for i in processed], processed,
                                out.failures)
        if index is not None and not self.raw_logprobs:
            chosen = logits[index]
        token_ids = sample(logits, [s.params for s in seqs], generators, self.default_generator, self.kernels())
        for i in processed:
            self.pipeline.accept(seqs[i], states[i], token_ids[i:i + 1], out.failures)
        if logprob_rows:
            positions = position_logprobs(chosen, [token_ids[i] for i in logprob_rows],
                                          [seqs[i].params.logprobs for i in logprob_rows])
            for i, position in zip(logprob_rows, positions):
                seqs[i].logprobs.append(position)
        for seq, token_id in zip(seqs, token_ids):
            out.events[seq] = RequestEvent((token_id,))

    def _score_prompts(self, run: StepRun, seqs: list[Sequence], owners: list[Request], out: Sampled) -> torch.Tensor:
        """Score the prompt positions the runner added after the sampling rows, and hand
        over the prompt logprobs of the requests whose prompts are complete; returns the
        sampling rows alone."""
        inputs, logits = run.inputs, run.logits
        num_rows = sum(inputs.num_logits_rows)
        if inputs.prompt_logits:
            offset = num_rows
            for row, first, count in inputs.prompt_logits:
                seq = run.plan.scheduled[row][0]
                scored = seq.prompt_logprobs
                scored.extend([None] * (first + 1 - len(scored)))  # positions the prefix cache skipped
                targets = seq.prompt_token_ids[first + 1: first + 1 + count]
                scored.extend(position_logprobs(logits[offset: offset + count], targets,
                                                [seq.params.prompt_logprobs] * count))
                offset += count
        for seq, request in zip(seqs, owners):
            if request.recipe.scores_prompt and seq.completion_index == 0 and not seq.output_token_ids:
                scored = seq.prompt_logprobs
                scored.extend([None] * (len(seq.prompt_token_ids) - len(scored)))  # cached positions at the end
                out.scored_prompts[request.request_id] = scored
        return logits[:num_rows]


def sampling_kernels_of(backend: Any) -> Callable[[], Any]:
    """What the sampler asks each step for the backend's sampling kernels: a backend's
    library may load after start, and a step never mixes the two paths."""
    if isinstance(backend, SamplingKernelsBackend):
        return lambda: backend.sampling_kernels
    return lambda: None

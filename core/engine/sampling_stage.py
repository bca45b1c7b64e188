"""The sampling stage: a step's logits become new tokens, in one place.

Rows arrive as the runner laid them out (`servelab.interfaces.sampling_rows`): one row per
sampling sequence, or 1 + k rows for a sequence verifying k drafts, then the prompt
positions scored for prompt logprobs. In order:

1. prompt logprobs are read off the prompt rows, which are then dropped;
2. plain rows (one per sequence): a request with n > 1 that has just computed its prompt
   samples all n first tokens from its one row (its n - 1 children are forked after the
   step); rows of requests with logits work are processed (penalties, bias, bans, the
   grammar mask), their logprobs read, then every row sampled;
3. draft rows: processed with the states their drafts lead to, then verified by the
   lossless rule (servelab.verification), and the processors settled;
4. the drafter keeps the hidden state behind each sequence's last token, when it reads them.

Requests with none of this take the plain path untouched: one `sample` call.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import torch

from servelab.interfaces import Sequence
from servelab.logits_pipeline import LogitsPipeline
from servelab.logprobs import log_softmax, position_logprobs
from servelab.request import Request, RequestTable
from servelab.sampler import sample
from servelab.speculation import Speculator


@attrs.define
class Sampled:
    """What the sampling stage decided for a step."""

    new_tokens: dict[Sequence, list[int]]  # accepted drafts + one token, per sequence that sampled
    forks: list[tuple[Sequence, list[Sequence]]]  # (parent, children) of n > 1 requests, to fork after the step
    num_drafts: dict[str, int]  # by sequence id: drafts verified
    num_accepted: dict[str, int]  # by sequence id: of which accepted
    failures: dict[str, str]  # by sequence id: a logits processor failed it (it gets no token)
    scored_prompts: dict[str, list]  # by request id: prompt logprobs completed this step
    paths: dict[str, tuple[int, ...]] = attrs.field(factory=dict)  # by sequence id: a token tree's accepted nodes


class SamplingStage:
    def __init__(self, requests: RequestTable, pipeline: LogitsPipeline, speculator: Speculator | None,
                 default_generator: torch.Generator, raw_logprobs: bool) -> None:
        self.requests = requests
        self.pipeline = pipeline
        self.speculator = speculator
        self.default_generator = default_generator
        self.raw_logprobs = raw_logprobs  # logprobs of the model's logits, before any processor

    def sample(self, plan: Any, inputs: Any, logits: torch.Tensor, hidden: torch.Tensor | None) -> Sampled:
        sampled = [plan.scheduled[row][0] for row in inputs.sampled_seq_rows]
        out = Sampled({}, [], {}, {}, {}, {})
        num_rows = inputs.num_logits_rows
        if self.requests.all_plain and num_rows.count(1) == len(num_rows):  # the common case, in one call
            token_ids = sample(logits, [s.params for s in sampled], [None] * len(sampled), self.default_generator)
            out.new_tokens = {seq: [token_id] for seq, token_id in zip(sampled, token_ids)}
            if hidden is not None:
                self.speculator.remember_hidden(sampled, list(range(len(sampled))), {}, hidden, [])
            return out
        owners = [self.requests.of(seq) for seq in sampled]
        # Requests with none of forks, logits work or prompt scoring (most) take the plain path.
        plain_only = not any(r.unforked or r.logits_work or r.scoring_prompt for r in owners)
        if inputs.prompt_logits:
            logits, hidden = self._score_prompts(plan, inputs, logits, hidden)
        if not plain_only and any(r.scoring_prompt for r in owners):
            self._note_scored_prompts(sampled, owners, out)
        if num_rows.count(1) == len(num_rows):  # nothing to verify: one row per sequence
            first_rows, plain, spec = list(range(len(num_rows))), list(range(len(num_rows))), []
            plain_logits = logits
        else:
            first_rows = np.cumsum([0] + num_rows[:-1]).tolist()
            plain = [i for i, n in enumerate(num_rows) if n == 1]
            spec = [i for i, n in enumerate(num_rows) if n > 1]
            plain_logits = logits[torch.tensor([first_rows[i] for i in plain], dtype=torch.int64,
                                               device=logits.device)]
        if plain:
            self._sample_plain(plain_logits, [sampled[i] for i in plain], [owners[i] for i in plain], out, plain_only)
        if spec:
            self._verify(logits, [sampled[i] for i in spec], [owners[i] for i in spec],
                         [first_rows[i] for i in spec], [num_rows[i] for i in spec], out)
        if hidden is not None:
            self.speculator.remember_hidden(sampled, first_rows, out.num_accepted, hidden, out.forks, out.paths)
        return out

    # ------------------------------------------------------------ plain rows

    def _sample_plain(self, logits: torch.Tensor, seqs: list[Sequence], owners: list[Request], out: Sampled,
                      plain_only: bool) -> None:
        if not plain_only and any(r.unforked for r in owners):
            logits, seqs, owners = self._with_forks(logits, seqs, owners, out)
        generators = [r.generators[s.completion_index] for s, r in zip(seqs, owners)]
        if not plain_only and any(r.logits_work for r in owners):
            token_ids = self._sample_with_logits_work(logits, seqs, owners, generators, out.failures)
        else:
            token_ids = sample(logits, [s.params for s in seqs], generators, self.default_generator)
        for seq, token_id in zip(seqs, token_ids):
            out.new_tokens[seq] = [token_id]

    def _with_forks(self, logits: torch.Tensor, seqs: list[Sequence], owners: list[Request], out: Sampled):
        """n > 1: a request's n first tokens all come from its one prefill row."""
        rows: list[int] = []
        all_seqs: list[Sequence] = []
        all_owners: list[Request] = []
        for row, (seq, request) in enumerate(zip(seqs, owners)):
            members = [seq]
            if request.unforked:
                request.unforked = False
                children = request.sequences[1:]
                for child in children:
                    child.first_scheduled_time = seq.first_scheduled_time
                members += children
                out.forks.append((seq, children))
            rows.extend([row] * len(members))
            all_seqs.extend(members)
            all_owners.extend([request] * len(members))
        return logits[torch.tensor(rows, device=logits.device)], all_seqs, all_owners

    def _sample_with_logits_work(self, logits: torch.Tensor, seqs: list[Sequence], owners: list[Request],
                                 generators: list[Any], failures: dict[str, str]) -> list[int]:
        """Sampling when some rows have processors or want logprobs (the others ride along)."""
        logprob_rows = [i for i, s in enumerate(seqs) if s.logprobs is not None]
        logprobs = _logprob_rows(logits, logprob_rows) if self.raw_logprobs else None
        states = [r.processor_states[s.completion_index] for s, r in zip(seqs, owners)]
        processed = [i for i, held in enumerate(states) if held]
        if processed:
            self.pipeline.apply(logits, [seqs[i] for i in processed], [states[i] for i in processed], processed,
                                failures)
        if not self.raw_logprobs:
            logprobs = _logprob_rows(logits, logprob_rows)
        token_ids = sample(logits, [s.params for s in seqs], generators, self.default_generator)
        for i in processed:
            self.pipeline.accept(seqs[i], states[i], token_ids[i:i + 1], failures)
        if logprob_rows:
            positions = position_logprobs(logprobs, [token_ids[i] for i in logprob_rows],
                                          [seqs[i].params.logprobs for i in logprob_rows])
            for i, position in zip(logprob_rows, positions):
                seqs[i].logprobs.append(position)
        return token_ids

    # ------------------------------------------------------------ draft rows

    def _verify(self, logits: torch.Tensor, seqs: list[Sequence], owners: list[Request], first_rows: list[int],
                num_rows: list[int], out: Sampled) -> None:
        worked = any(r.logits_work for r in owners)
        states = [r.processor_states[s.completion_index] for s, r in zip(seqs, owners)]
        row_logprobs = self._process_draft_rows(logits, seqs, states, first_rows, num_rows, out) if worked else {}
        verified = self.speculator.verify(seqs, logits, first_rows, num_rows,
                                          [r.generators[s.completion_index] for s, r in zip(seqs, owners)],
                                          self.default_generator)
        for seq, held, n, result in zip(seqs, states, num_rows, verified):
            out.new_tokens[seq] = result.token_ids
            out.num_drafts[seq.request_id] = n - 1
            out.num_accepted[seq.request_id] = result.num_accepted
            if result.path is not None:
                out.paths[seq.request_id] = result.path
            if held:  # processors forget rejected drafts and take the target's token
                self.pipeline.settle_speculative(seq, held, n - 1, result.num_accepted, result.token_ids, out.failures)
            rows = row_logprobs.get(seq.request_id)
            if rows is not None:  # emitted token i's logprob is read off the row that verified it
                tokens = result.token_ids
                seq.logprobs.extend(position_logprobs(rows[: len(tokens)], tokens, [seq.params.logprobs] * len(tokens)))

    def _process_draft_rows(self, logits: torch.Tensor, seqs: list[Sequence], states: list[dict],
                            first_rows: list[int], num_rows: list[int], out: Sampled) -> dict[str, torch.Tensor]:
        """Each sequence's rows processed with the states its drafts lead to (accepted
        tentatively), and the logprobs of the rows of those that want them."""

        def rows_logprobs() -> dict[str, torch.Tensor]:
            wanted = [(s, first, n) for s, first, n in zip(seqs, first_rows, num_rows) if s.logprobs is not None]
            if not wanted:
                return {}
            logprobs = _logprob_rows(logits, [first + j for _, first, n in wanted for j in range(n)])
            starts = np.cumsum([0] + [n for _, _, n in wanted]).tolist()
            return {s.request_id: logprobs[start: start + n] for (s, _, n), start in zip(wanted, starts)}

        raw = rows_logprobs() if self.raw_logprobs else {}
        self.pipeline.apply_speculative(logits, seqs, states, first_rows, num_rows, out.failures)
        return raw if self.raw_logprobs else rows_logprobs()

    # ------------------------------------------------------------ prompt logprobs

    def _score_prompts(self, plan: Any, inputs: Any, logits: torch.Tensor, hidden: torch.Tensor | None):
        """Score the prompt positions the runner added after the sampling rows; returns the
        sampling rows (logits, hidden) alone."""
        num_rows = sum(inputs.num_logits_rows)
        logprobs = log_softmax(logits[num_rows:])
        offset = 0
        for row, first, count in inputs.prompt_logits:
            seq = plan.scheduled[row][0]
            scored = seq.prompt_logprobs
            scored.extend([None] * (first + 1 - len(scored)))  # positions the prefix cache skipped
            targets = seq.prompt_token_ids[first + 1: first + 1 + count]
            scored.extend(position_logprobs(logprobs[offset: offset + count], targets,
                                            [seq.params.prompt_logprobs] * count))
            offset += count
        return logits[:num_rows], hidden[:num_rows] if hidden is not None else None

    @staticmethod
    def _note_scored_prompts(sampled: list[Sequence], owners: list[Request], out: Sampled) -> None:
        for seq, request in zip(sampled, owners):
            if request.scoring_prompt and seq.completion_index == 0:
                scored = seq.prompt_logprobs
                scored.extend([None] * (len(seq.prompt_token_ids) - len(scored)))  # cached positions at the end
                request.scoring_prompt = False
                out.scored_prompts[request.request_id] = scored


def _logprob_rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor | None:
    if not rows:
        return None
    return log_softmax(logits[torch.tensor(rows, dtype=torch.int64, device=logits.device)])

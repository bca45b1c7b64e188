"""The verify stage: each sequence's drafts checked against the target's rows, and once
the update stage appended the tokens, the verified drafts settled.

`verify`, after the sampling stage: a sequence with k drafts has 1 + k logits rows; its
rows are processed with the states its drafts lead to (logits processors), verified by
the lossless rule (servelab.verification), the processors settled and the logprobs of
the emitted tokens read off the rows that verified them. The drafter's per-sequence
state is kept on the request (`Drafting`): the hidden state behind each sequence's last
token, the features of the rows this step computed.

`settle`, inside the update stage after the tokens were appended: the K/V of verified
tokens only is kept (a token tree's accepted path moved into place first), rejected
slots go back to the allocator, the drafter hears what was accepted and the features of
the verified rows, the step's drafts are dropped and the totals counted.
"""

from __future__ import annotations

import itertools
from typing import Any, Sequence as Seq

import torch

from servelab.interfaces import Sequence
from servelab.logits_pipeline import LogitsPipeline
from servelab.logprobs import position_logprobs
from servelab.outputs import RequestEvent
from servelab.request import Request, RequestTable
from servelab.run_stage import StepRun
from servelab.sampling_stage import Sampled
from servelab.speculation import Speculator
from servelab.token_tree import is_chain
from servelab.verification import verify


class VerifyStage:
    def __init__(self, requests: RequestTable, speculator: Speculator, pipeline: LogitsPipeline,
                 default_generator: torch.Generator, raw_logprobs: bool) -> None:
        self.requests = requests
        self.speculator = speculator
        self.pipeline = pipeline
        self.default_generator = default_generator
        self.raw_logprobs = raw_logprobs
        # This step's features [T, F] and, per scheduled sequence, (seq, first position, first row).
        self._features: torch.Tensor | None = None
        self._feature_rows: list[tuple[Sequence, int, int]] = []

    def verify(self, run: StepRun, sampled: Sampled) -> None:
        rows = sampled.rows
        spec = [i for i, n in enumerate(rows.num_rows) if n > 1]
        if not spec and run.hidden is None and run.features is None:
            return
        owners = rows.owners if rows.owners is not None else [self.requests.of(seq) for seq in rows.seqs]
        if spec:
            self._verify(run.logits, [rows.seqs[i] for i in spec], [owners[i] for i in spec],
                         [rows.first_rows[i] for i in spec], [rows.num_rows[i] for i in spec], sampled)
        if run.hidden is not None:
            self._keep_hidden(run.hidden, rows.seqs, owners, rows.first_rows, sampled)
        if run.features is not None:
            self._features, self._feature_rows = run.features, _rows_of(run.plan)

    def _verify(self, logits: torch.Tensor, seqs: list[Sequence], owners: list[Request], first_rows: list[int],
                num_rows: list[int], out: Sampled) -> None:
        states = [r.processor_states[s.completion_index] for s, r in zip(seqs, owners)]
        logprobs: dict[str, torch.Tensor] = {}
        if any(r.recipe.logits_work for r in owners):
            # each sequence's rows processed with the states its drafts lead to (accepted
            # tentatively); the logprobs of those that want them read off the model's
            # logits or the processed ones (`[engine] logprobs_mode`)
            wanted = [(s, first, n) for s, first, n in zip(seqs, first_rows, num_rows) if s.logprobs is not None]
            index = torch.tensor([first + j for _, first, n in wanted for j in range(n)], dtype=torch.int64,
                                 device=logits.device) if wanted else None
            raw = logits[index] if index is not None and self.raw_logprobs else None  # a copy: processing is in place
            self.pipeline.apply_speculative(logits, seqs, states, first_rows, num_rows, out.failures)
            if index is not None:
                rows = raw if self.raw_logprobs else logits[index]
                starts = list(itertools.accumulate((n for _, _, n in wanted), initial=0))
                logprobs = {s.request_id: rows[start: start + n] for (s, _, n), start in zip(wanted, starts)}
        drafts = [seq.draft_token_ids[: n - 1] for seq, n in zip(seqs, num_rows)]
        probs, parents = [], []
        for seq, request, draft in zip(seqs, owners, drafts):
            drafting = request.drafts[seq.completion_index]
            probs.append(drafting.probs[: len(draft)] if drafting.probs is not None else None)
            tree = drafting.parents[: len(draft)] if drafting.parents is not None else None
            parents.append(tree if tree is not None and not is_chain(tree) else None)
        picked = torch.tensor([r for first, n in zip(first_rows, num_rows) for r in range(first, first + n)],
                              dtype=torch.int64, device=logits.device)
        verified = verify(logits[picked], drafts, probs, [seq.params for seq in seqs],
                          [r.generators[s.completion_index] for s, r in zip(seqs, owners)], self.default_generator,
                          parents if any(tree is not None for tree in parents) else None)
        for seq, held, n, result in zip(seqs, states, num_rows, verified):
            out.events[seq] = RequestEvent(tuple(result.token_ids))
            out.num_drafts[seq.request_id] = n - 1
            out.num_accepted[seq.request_id] = result.num_accepted
            if result.path is not None:
                out.paths[seq.request_id] = result.path
            if held:  # processors forget rejected drafts and take the target's token
                self.pipeline.settle_speculative(seq, held, n - 1, result.num_accepted, result.token_ids, out.failures)
            rows = logprobs.get(seq.request_id)
            if rows is not None:  # emitted token i's logprob is read off the row that verified it
                tokens = result.token_ids
                seq.logprobs.extend(position_logprobs(rows[: len(tokens)], tokens, [seq.params.logprobs] * len(tokens)))

    def _keep_hidden(self, hidden: torch.Tensor, seqs: Seq[Sequence], owners: Seq[Request], first_rows: Seq[int],
                     out: Sampled) -> None:
        """Per sequence, the hidden state of the row that produced its last token: the row
        after its accepted drafts, a tree's last accepted node's (forked children share
        their parent's)."""
        for seq, request, first in zip(seqs, owners, first_rows):
            path = out.paths.get(seq.request_id)
            offset = (path[-1] + 1 if path else 0) if path is not None else out.num_accepted.get(seq.request_id, 0)
            request.drafts[seq.completion_index].hidden = hidden[first + offset]
        for parent, children in out.forks:
            request = self.requests.of(parent)
            for child in children:
                request.drafts[child.completion_index].hidden = request.drafts[parent.completion_index].hidden

    # ------------------------------------------------------------ after the tokens are appended

    def settle(self, sampled: Sampled) -> None:
        """After the update stage cut each sequence's event at its stop."""
        num_drafts, num_accepted = sampled.num_drafts, sampled.num_accepted
        for seq, event in sampled.events.items():  # those a processor failed are no longer there
            if seq.request_id in num_drafts:
                self._settle(seq, num_drafts[seq.request_id], num_accepted[seq.request_id],
                             seq.num_tokens - len(event.new_token_ids), sampled.paths.get(seq.request_id))
        if self._features is not None:
            self._observe_features()
        spec = self.speculator
        spec.end_step()
        spec.record(sum(num_drafts.values()), sum(num_accepted.values()), len(num_drafts), len(sampled.events),
                    sum(len(event.new_token_ids) for event in sampled.events.values()))

    def _settle(self, seq: Sequence, num_verified_drafts: int, num_accepted: int, num_tokens_before: int,
                path: Seq[int] | None) -> None:
        """Keep the K/V of verified tokens only and give the rejected drafts' slots back.
        `path`: a token tree's accepted nodes, whose K/V moves first from node i's slot to
        the slot of the token it became."""
        spec = self.speculator
        if spec.accepting is not None and num_verified_drafts:
            accepted = [seq.draft_token_ids[i] for i in path] if path is not None else seq.draft_token_ids[:num_accepted]
            spec.accepting.accepted(seq.request_id, list(accepted))
        computed = seq.num_computed_tokens
        keep = min(num_tokens_before + num_accepted, seq.num_tokens)
        if path is not None:
            self._move_path(seq, path[: keep - num_tokens_before], num_tokens_before)
            if spec.feature_drafter is not None:
                self.requests.of(seq).drafts[seq.completion_index].path = list(path)
        if computed > keep:
            spec.allocator.rollback(seq.request_id, computed - keep)
            seq.num_computed_tokens = keep
        seq.num_draft_tokens += num_verified_drafts
        seq.num_accepted_tokens += num_accepted
        if spec.dynamic is not None:
            spec.dynamic.observe(seq.request_id, num_verified_drafts, num_accepted)

    def _move_path(self, seq: Sequence, path: Seq[int], first: int) -> None:
        """Accepted node path[j] was computed at logical position first + path[j]; its token
        is now the sequence's token first + j. Sources never precede destinations (nodes
        are listed parents first), and every source is read before any write."""
        moves = [(first + node, first + j) for j, node in enumerate(path) if node != j]
        if not moves:
            return
        spec = self.speculator
        table = spec.allocator.block_table(seq.request_id)
        size = spec.block_size

        def slot(position: int) -> int:
            return table[position // size] * size + position % size

        spec.slot_mover([(slot(source), slot(destination)) for source, destination in moves])

    def _observe_features(self) -> None:
        """Each sequence's verified rows go to the FeatureDrafter."""
        features, self._features = self._features, None
        rows, self._feature_rows = self._feature_rows, []
        for seq, start, first in rows:
            drafting = self.requests.of(seq).drafts[seq.completion_index]
            path, drafting.path = drafting.path, None
            count = seq.num_computed_tokens - start  # positions now verified (rejected drafts rolled back)
            if count <= 0 or seq.finish_reason is not None:
                continue
            if path is None:
                verified = features[first: first + count]
            else:  # a tree: the last token's row, then the accepted nodes' (node i is row 1 + i)
                verified = features[torch.tensor([first] + [first + 1 + node for node in path[: count - 1]])]
            prompt, lo, hi = seq.prompt_token_ids, start + 1, start + 1 + count
            tokens = prompt[lo:hi] + seq.output_token_ids[max(0, lo - len(prompt)): max(0, hi - len(prompt))]
            self.speculator.feature_drafter.observe(seq.request_id, start, verified, tokens)


def _rows_of(plan: Any) -> list[tuple[Sequence, int, int]]:
    """Per scheduled sequence: (seq, its first position this step, its first input row)."""
    rows, row = [], 0
    for seq, num_new in plan.scheduled:
        rows.append((seq, seq.num_computed_tokens, row))
        row += num_new
    return rows

"""The intake stage: a caller's prompt and SamplingParams become a Request record.

Everything about a request is checked here, once, before anything changes: the
prompt's tokens against the vocabulary and max_model_len, the params against what the
engine's policies can do (forking for n > 1, prompt logprobs, each selected logits
processor's own `validate`). Building the record then starts what the request needs
before it can be queued: its random generators, its stop-string text, and its logits
processors' preparation (grammar compilation runs on a worker thread; the request waits
for it while the others run). A request another engine began (RequestSpec.continues: a
disaggregated deployment's decode engine) starts with that engine's tokens as its output,
its stop-string text and its processors' states past them.
"""

from __future__ import annotations

from typing import Any, Sequence as Seq

import torch

from servelab.detokenize import IncrementalText
from servelab.errors import RequestError
from servelab.interfaces import Runner
from servelab.logits_pipeline import LogitsPipeline, ProcessorFailed
from servelab.request import Request, RequestSpec
from servelab.sampling_params import SamplingParams
from servelab.sampling_recipe import recipe_of
from servelab.sequence import Sequence, sequence_id


def _all_token_ids(prompt: list | tuple) -> bool:
    """Every item is an int, not a bool."""
    return set(map(type, prompt)) <= {int} or all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)


class Intake:
    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int, max_logprobs: int,
                 pipeline: LogitsPipeline, runner: Runner, fork_refusal: str | None, lora: Any = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_logprobs = max_logprobs
        self.pipeline = pipeline
        self.device = runner.device
        self.fork_refusal = fork_refusal  # why n > 1 cannot be served, or None
        self.scores_prompts = bool(runner.supports_prompt_logprobs)
        self.runner_name = type(runner).__name__
        self.lora = lora  # the engine's LoRA adapters (servelab.lora_manager.LoRAManager), when it serves them

    def encode(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt, validated against the vocabulary and max_model_len."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this checkpoint has no tokenizer.json: pass prompts as lists of token ids")
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and _all_token_ids(prompt):
            token_ids = list(prompt)
        else:
            raise RequestError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not token_ids:
            raise RequestError("prompt is empty")
        if len(token_ids) > self.max_model_len:
            raise RequestError(f"prompt has {len(token_ids)} tokens, more than max_model_len={self.max_model_len}")
        if min(token_ids) < 0 or max(token_ids) >= self.vocab_size:
            bad = next(t for t in token_ids if not 0 <= t < self.vocab_size)
            raise RequestError(f"prompt token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        return token_ids

    def check_all(self, specs: Seq[RequestSpec]) -> list[list[int]]:
        """Each prompt's token ids, or RequestError naming what is wrong (changing nothing);
        params shared by several prompts (one object) are checked once."""
        seen: set[int] = set()
        for spec in specs:
            if id(spec.params) not in seen:
                self.check_params(spec.params)
                seen.add(id(spec.params))
            self.lora_id(spec.lora_request)
        checked = [self.encode(spec.prompt) for spec in specs]
        for spec, token_ids in zip(specs, checked):
            if spec.continues:
                self.check_continues(spec, token_ids)
        return checked

    @staticmethod
    def check_continues(spec: RequestSpec, token_ids: list[int]) -> None:
        """RequestError unless `spec.continues` names the prompt's last tokens (leaving one
        or more) of a request this engine can continue: one completion, its prompt scored
        elsewhere, and tokens left to generate."""
        continued = tuple(spec.continues)
        params = spec.params or SamplingParams()
        if len(continued) >= len(token_ids) or tuple(token_ids[-len(continued):]) != continued:
            raise RequestError(f"continues must name the prompt's last tokens and leave at least one prompt token; "
                               f"got {len(continued)} tokens for a prompt of {len(token_ids)}")
        if params.n != 1:
            raise RequestError(f"a request continued from another engine (continues) has one completion, "
                               f"got n={params.n}")
        if params.prompt_logprobs is not None:
            raise RequestError("a request continued from another engine (continues) cannot score its prompt "
                               "(prompt_logprobs): the engine that computed the prompt scores it")
        if len(continued) >= params.max_tokens:
            raise RequestError(f"continues names {len(continued)} generated tokens, which max_tokens="
                               f"{params.max_tokens} leaves nothing to generate after")

    def lora_id(self, lora_request: Any) -> int:
        """The id of the adapter a request names (read and checked the first time), 0 for
        none; RequestError for one this engine cannot serve."""
        if lora_request is None:
            return 0
        if self.lora is None:
            raise RequestError("this engine serves no LoRA adapters: start it with [engine] enable_lora = true")
        return self.lora.register(lora_request)

    def check_params(self, params: SamplingParams | None) -> None:
        if params is not None:
            if not isinstance(params, SamplingParams):
                raise RequestError(f"params must be SamplingParams, got {type(params).__name__}")
            if params.stop and self.tokenizer is None:
                raise RequestError("stop strings need a tokenizer; this checkpoint has none")
            if params.top_k > self.vocab_size:
                raise RequestError(f"top_k must be -1 (disabled) or in 1..{self.vocab_size} "
                                   f"(the vocabulary), got {params.top_k}")
            if params.n > 1 and self.fork_refusal is not None:
                raise RequestError(f"n={params.n} samples by forking the prompt's KV, but {self.fork_refusal}")
            if params.has_logits_work or self.pipeline.defaults:
                self._check_logits_work(params)

    def _check_logits_work(self, params: SamplingParams) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.max_logprobs:
                raise RequestError(f"{name} must be <= {self.max_logprobs} (the engine's max_logprobs), got {value}")
        if params.prompt_logprobs is not None and not self.scores_prompts:
            raise RequestError(f"prompt_logprobs: this engine's model runner ({self.runner_name}) "
                               f"cannot score prompts")
        self.pipeline.validate(params)

    def build(self, spec: RequestSpec, token_ids: list[int], request_id: str, arrival_time: float,
              shared: dict[int, dict] | None = None) -> Request:
        """The record of a checked request, its preparation started (or taken from `shared`,
        by params object, when another prompt of the same request started it); RequestError
        (with nothing left behind) when a processor refuses it."""
        params = spec.params or SamplingParams()
        n = params.n
        lora_id = self.lora_id(spec.lora_request)
        prompt = token_ids[:len(token_ids) - len(spec.continues)] if spec.continues else token_ids
        seqs = [Sequence(sequence_id(request_id, i), prompt, params, arrival_time, priority=spec.priority,
                         output_token_ids=list(spec.continues), completion_index=i, lora_id=lora_id)
                for i in range(n)]
        generators: list[Any] = [None] * n
        if params.seed is not None:  # a seed torch refuses raises here, before anything exists
            generators = [torch.Generator(device=self.device).manual_seed(params.seed + i) for i in range(n)]
        texts = [IncrementalText(self.tokenizer, params.stop) if params.stop else None for _ in seqs]
        if spec.continues:
            for text in filter(None, texts):
                text.append(list(spec.continues))
        recipe = recipe_of(params, bool(self.pipeline.defaults))
        request = Request(request_id, spec.prompt if isinstance(spec.prompt, str) else None, params, recipe, seqs,
                          generators, texts, [{} for _ in seqs])
        if recipe.logits_work:
            self._start_logits_work(request, {} if shared is None else shared)
        return request

    def _start_logits_work(self, request: Request, shared: dict[int, dict]) -> None:
        params = request.params
        if id(params) not in shared:
            shared[id(params)] = self.pipeline.prepare(params)
        request.preparing = dict(shared[id(params)])
        if not request.preparing:
            self.create_states(request, {})
        if params.logprobs is not None:
            for seq in request.sequences:
                seq.logprobs = [None] * len(seq.output_token_ids)  # continued tokens: scored elsewhere
        if params.prompt_logprobs is not None:
            request.first.prompt_logprobs = [None]  # the first token: nothing predicts it

    def finish_preparation(self, request: Request) -> None:
        """Once every preparation is done: the processors' states (RequestError when one failed)."""
        futures, request.preparing = request.preparing, {}
        errors = [f"logits processor {name!r} failed to prepare: "
                  f"{'cancelled' if future.cancelled() else future.exception()}"
                  for name, future in futures.items() if future.cancelled() or future.exception() is not None]
        if errors:
            raise RequestError(errors[0])
        self.create_states(request, {name: future.result() for name, future in futures.items()})

    def create_states(self, request: Request, prepared: dict[str, Any]) -> None:
        made = []
        try:
            for i, seq in enumerate(request.sequences):
                request.processor_states[i] = self.pipeline.new_states(seq, prepared)
                made.append(i)
                self._accept_continued(seq, request.processor_states[i])
        except ProcessorFailed as exc:
            for i in made:
                self.pipeline.release(request.sequences[i].request_id, request.processor_states[i])
                request.processor_states[i] = {}
            raise RequestError(str(exc)) from None

    def _accept_continued(self, seq: Sequence, states: dict[str, Any]) -> None:
        """The processors accept the output tokens another engine generated (RequestSpec.continues),
        as they accepted them there: penalties count them, a grammar advances over them."""
        if seq.output_token_ids and states:
            failed: dict[str, str] = {}
            self.pipeline.accept(seq, states, seq.output_token_ids, failed)
            if failed:
                raise ProcessorFailed(failed[seq.request_id])

"""One HTTP request in the engine: one engine request per prompt, each with the request's
n (the engine samples n > 1 by forking the prompt's KV; completion i of a seeded request
uses seed + i), and each choice's tokens turned into text deltas.

Choice `prompt_index * n + i` is completion i of prompt `prompt_index`, OpenAI's order.
Deltas carry `stream_interval` tokens each (1 by default: one token per stream chunk, as
vLLM); a token whose text is held back (an incomplete UTF-8 character, the start of a
possible stop string, a special token) has a delta with empty text, and its text comes
with a later one's.
A client that goes away aborts every unfinished engine request at once (the deltas
generator's `finally`), which frees their KV blocks before the engine's next step.
"""

from __future__ import annotations

import time
from typing import Any, AsyncIterator, Sequence as Seq

import attrs
import structlog

from servelab.detokenize import IncrementalText
from servelab.outputs import CompletionOutput, RequestEvent, RequestOutput, with_token_text
from servelab.sampling_params import SamplingParams
from servelab.sequence import owner_of, sequence_id as completion_id
from servelab.server.codec import CodecFailure
from servelab.server.engine_loop import AsyncEngine, NewRequest

logger = structlog.get_logger(__name__)


class EngineFailure(Exception):
    """The engine failed while this request was in flight."""


class RequestFailed(EngineFailure):
    """The engine failed one of this request's prompts alone (a logits processor raised)."""


@attrs.frozen
class ChoiceDelta:
    """New text of one choice; `finish_reason` is set on the choice's last delta.

    `logprobs`: (token id, {token id: Logprob}) for the tokens behind this delta's text
    (SamplingParams.logprobs); `prompt_logprobs`: the prompt's, once scored."""

    index: int
    text: str
    finish_reason: str | None
    logprobs: tuple[tuple[int, Any], ...] = ()
    prompt_logprobs: tuple[Any, ...] | None = None
    num_tokens: int = 0  # the generated tokens behind this delta
    stop_reason: int | str | None = None  # with finish_reason "stop": the stop string or token id

    def then(self, later: "ChoiceDelta") -> "ChoiceDelta":
        """This delta and the next one of the same choice, as one."""
        return ChoiceDelta(self.index, self.text + later.text, later.finish_reason, self.logprobs + later.logprobs,
                           self.prompt_logprobs if later.prompt_logprobs is None else later.prompt_logprobs,
                           self.num_tokens + later.num_tokens, later.stop_reason)


class TextStreamer:
    """Text deltas of one choice. The concatenated deltas equal the final text.

    Text ending in an incomplete UTF-8 sequence is held back, and so are the last
    (longest stop string - 1) characters, which a stop string completed by the next
    token could still claim: a stop string never reaches the client.

    Decoding is incremental (servelab.detokenize, the engine's stop strings use the same):
    each call decodes a window of the last few tokens, so a long output costs O(1) per token.
    """

    def __init__(self, tokenizer: Any, stop: Seq[str]) -> None:
        self._tokenizer = tokenizer
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self._text = IncrementalText(tokenizer, ()) if tokenizer is not None else None
        self.emitted = ""

    @property
    def token_ids(self) -> list[int]:
        return self._text.token_ids if self._text is not None else []

    def feed(self, new_token_ids: Seq[int], completion: CompletionOutput | None) -> str:
        """The text to send now for these new tokens (and the finished completion, if any)."""
        if self._text is None:
            return ""
        if completion is not None:
            text = self.final_text(completion)
        else:
            self._text.append(new_token_ids)
            text = self._text.text[: max(0, len(self._text.text) - self._holdback)]
        delta = text[len(self.emitted):]
        self.emitted += delta
        return delta

    def final_text(self, completion: CompletionOutput) -> str:
        """The completion's text as the engine decoded it, cut before the stop string
        that ended it, if one did."""
        return completion.text if self._tokenizer is not None else ""


@attrs.define
class Choice:
    """One choice: which engine sequence it is, and what it has produced."""

    index: int
    prompt_index: int
    sequence_id: str  # the engine's key for its new tokens
    streamer: TextStreamer
    output: CompletionOutput | None = None
    unsent_logprobs: list = attrs.field(factory=list)  # (token id, logprobs) not yet sent with text
    unsent_tokens: int = 0  # tokens fed but not yet counted in a delta (their text held back)
    sent_tokens: int = 0

    def take_tokens(self) -> int:
        taken, self.unsent_tokens = self.unsent_tokens, 0
        self.sent_tokens += taken
        return taken

    @property
    def text(self) -> str:
        return self.streamer.emitted

    @property
    def finish_reason(self) -> str | None:
        return self.output.finish_reason if self.output is not None else None


class Generation:
    """The engine requests behind one HTTP request, and their deltas."""

    def __init__(self, engine: AsyncEngine, tokenizer: Any, prompts: Seq[list[int]], params: SamplingParams,
                 n: int, request_id: str, endpoint: str, echo_texts: Seq[str] | None = None,
                 max_tokens: Seq[int] | None = None, scoring_only: bool = False, stream_interval: int = 1,
                 lora_request: Any = None) -> None:
        """`max_tokens`: each prompt's own (clipped to its context), else params'.
        `scoring_only` (max_tokens 0): the prompt is scored and the token its prefill
        samples is left out of the choices and the usage."""
        self.engine = engine
        self.lora_request = lora_request  # the LoRA adapter every prompt runs with (servelab.LoRARequest), or None
        self.scoring_only = scoring_only
        self.stream_interval = stream_interval
        self._pending: dict[int, ChoiceDelta] = {}  # a choice's tokens not yet stream_interval of them
        self.echo_texts = list(echo_texts) if echo_texts is not None else None  # completions' echo: prompt texts
        self.request_id = request_id
        self.endpoint = endpoint
        self.created = int(time.time())
        self._prompts = list(prompts)
        self.prompts = self._prompts  # token ids of each prompt
        self._params = attrs.evolve(params, n=n)
        self.params = self._params
        self._prompt_params = [self._params if max_tokens is None or limit == self._params.max_tokens
                               else attrs.evolve(self._params, max_tokens=limit)
                               for limit in (max_tokens or [None] * len(prompts))]
        self.engine_request_ids = [f"{request_id}-{p}" for p in range(len(prompts))]
        self.choices = [Choice(p * n + i, p, completion_id(rid, i), TextStreamer(tokenizer, params.stop))
                        for p, rid in enumerate(self.engine_request_ids) for i in range(n)]
        self._by_sequence = {c.sequence_id: c for c in self.choices}
        self.outputs: dict[str, RequestOutput] = {}  # engine request id -> its output, once finished
        self._events = None
        self._tokenizer = tokenizer
        self._token_texts: dict[int, str] = {}  # token id -> its text, for logprobs

    async def start(self, arrival_time: float) -> None:
        """Queue every prompt in the engine (RequestError / EngineUnavailable propagate)."""
        self._events = await self.engine.add([NewRequest(rid, prompt, params, arrival_time, self.lora_request)
                                              for rid, prompt, params
                                              in zip(self.engine_request_ids, self._prompts, self._prompt_params)],
                                             decode=self._text_deltas)

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        """Every choice's text deltas as the engine produces them, until all have finished.

        A delta carries `stream_interval` tokens (held back until that many came, or the
        choice finished), so a slow reader gets as many chunks as a fast one. The text was
        decoded on the detokenizer's thread. EngineFailure / CodecFailure end it.
        """
        unfinished = set(self.engine_request_ids)
        status = "aborted"
        try:
            while unfinished:
                deltas, outputs = await self._next_events()
                errors = []
                for output in outputs:
                    self.outputs[output.request_id] = output
                    unfinished.discard(output.request_id)
                    if output.error is not None:
                        errors.append(output.error)
                for delta in deltas:
                    yield delta
                if errors:
                    raise RequestFailed(errors[0])
            status = "ok"
        except RequestFailed:
            status = "failed"
            raise
        except EngineFailure:
            unfinished.clear()  # the engine has dropped them already
            status = "failed"
            raise
        except CodecFailure:
            status = "failed"
            raise
        finally:
            if unfinished:
                self.engine.abort(unfinished)
            self._log(status)

    def _text_deltas(self, events: dict[str, RequestEvent]) -> list[ChoiceDelta]:
        """The deltas for one step's events of this request's prompts, by sequence id (runs on
        the detokenizer's thread)."""
        by_sequence = self._by_sequence
        outputs = [event.output for event in events.values() if event.output is not None]
        finishing = {output.request_id for output in outputs}
        deltas = []
        for request_id, event in events.items():
            if event.prompt_logprobs:
                scored = tuple(self._with_text(event.prompt_logprobs))
                deltas.extend(ChoiceDelta(c.index, "", None, prompt_logprobs=scored) for c in self.choices
                              if self.engine_request_ids[c.prompt_index] == request_id)
        for sequence_id, event in events.items():
            token_ids = event.new_token_ids
            if self.scoring_only:
                break  # the one token the prefill sampled is not part of the answer
            if not token_ids:
                continue
            choice = by_sequence[sequence_id]
            if event.new_logprobs:
                choice.unsent_logprobs.extend(zip(token_ids, self._with_text(event.new_logprobs)))
            finishing_now = owner_of(sequence_id) in finishing
            # its final text comes from the output (a stop string may cut it): the tokens before
            # the last are streamed one by one, the last with the output
            for token_id in token_ids[:-1] if finishing_now else token_ids:
                choice.unsent_tokens += 1
                text = choice.streamer.feed((token_id,), None)
                deltas.append(ChoiceDelta(choice.index, text, None, self._take_logprobs(choice, choice.unsent_tokens),
                                          num_tokens=choice.take_tokens()))
        for output in outputs:
            for completion in output.outputs:
                choice = by_sequence[completion_id(output.request_id, completion.index)]
                if self.scoring_only:  # as if nothing was sampled: max_tokens 0 ends at "length"
                    completion = attrs.evolve(completion, token_ids=[], text="", finish_reason="length",
                                              logprobs=[] if completion.logprobs is not None else None,
                                              stop_reason=None)
                    choice.unsent_logprobs.clear()
                choice.output = completion
                choice.unsent_tokens = len(completion.token_ids) - choice.sent_tokens
                deltas.append(ChoiceDelta(choice.index, choice.streamer.feed((), completion), choice.finish_reason,
                                          self._take_logprobs(choice), num_tokens=choice.take_tokens(),
                                          stop_reason=completion.stop_reason))
        return deltas

    @staticmethod
    def _take_logprobs(choice: Choice, up_to: int | None = None) -> tuple[tuple[int, Any], ...]:
        """The logprobs not yet sent, or only as many as the tokens sent so far cover."""
        pending = choice.unsent_logprobs
        count = len(pending) if up_to is None else min(up_to, len(pending))
        taken = tuple(pending[:count])
        del pending[:count]
        return taken

    def _with_text(self, positions: Seq[Any]) -> list[Any]:
        """Logprobs with each token's text filled in (decoded once per token id)."""
        decode = self._tokenizer.decode if self._tokenizer is not None else (lambda token_ids: "")
        return with_token_text(positions, decode, self._token_texts)

    async def _next_events(self) -> tuple[list[ChoiceDelta], list[RequestOutput]]:
        """The next event and every one already queued: their text deltas (merged into one
        per choice, in order), and the outputs of requests that finished."""
        events: list[tuple[str, RequestEvent]] = [await self._events.get()]
        while not self._events.empty():
            events.append(self._events.get_nowait())
        ready: list[ChoiceDelta] = []
        outputs = []
        pending, interval = self._pending, self.stream_interval
        for _, event in events:
            if event.error is not None:
                raise EngineFailure(event.error)
            if event.decode_error is not None:
                raise CodecFailure(f"detokenizing the output failed: {event.decode_error}")
            for delta in event.deltas:
                earlier = pending.pop(delta.index, None)
                if earlier is not None:
                    delta = earlier.then(delta)
                if delta.finish_reason is None and delta.prompt_logprobs is None and delta.num_tokens < interval:
                    pending[delta.index] = delta  # fewer than stream_interval tokens yet
                else:
                    ready.append(delta)
            if event.output is not None:
                outputs.append(event.output)
        return ready, outputs

    def prompt_token_ids(self, choice: Choice) -> list[int]:
        output = self.outputs.get(self.engine_request_ids[choice.prompt_index])
        return list(output.prompt_token_ids) if output is not None else list(self._prompts[choice.prompt_index])

    def prompt_logprobs(self, choice: Choice) -> list[Any] | None:
        """The finished request's prompt logprobs (None until it finished, or when not asked)."""
        output = self.outputs.get(self.engine_request_ids[choice.prompt_index])
        return output.prompt_logprobs if output is not None else None

    def usage(self) -> dict[str, int]:
        """OpenAI usage: prompt tokens once per prompt, completion tokens of every choice
        (so far, while they run)."""
        prompt_tokens = sum(len(output.prompt_token_ids) for output in self.outputs.values())
        prompt_tokens += sum(len(self._prompts[p]) for p, rid in enumerate(self.engine_request_ids)
                             if rid not in self.outputs)
        completion_tokens = sum(len(c.output.token_ids) if c.output is not None else c.sent_tokens
                                for c in self.choices)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def _log(self, status: str) -> None:
        usage = self.usage()
        ttfts = [o.metrics.ttft for o in self.outputs.values() if o.metrics.ttft is not None]
        logger.info("request.finished", request_id=self.request_id, endpoint=self.endpoint, status=status,
                    choices=len(self.choices), prompt_tokens=usage["prompt_tokens"],
                    completion_tokens=usage["completion_tokens"],
                    finish_reasons=sorted({str(c.finish_reason) for c in self.choices}),
                    ttft_ms=round(min(ttfts) * 1000, 2) if ttfts else None)



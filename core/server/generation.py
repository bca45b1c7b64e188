"""One HTTP request's choices in the engine: n per prompt, each an engine request, with
each choice's tokens turned into text deltas.

`n > 1` is served here by fanning out: choice i of a prompt is its own engine request
whose seed, when the request gives one, is `seed + i` (so choice 0 is exactly the n = 1
answer). A client that goes away aborts every unfinished choice at once (the deltas
generator's `finally`), which frees their KV blocks before the engine's next step.
"""

from __future__ import annotations

import time
from typing import Any, AsyncIterator, Sequence as Seq

import attrs
import structlog

from servelab.outputs import RequestOutput
from servelab.sampling_params import SamplingParams
from servelab.server.engine_loop import AsyncEngine, NewRequest

logger = structlog.get_logger(__name__)


class EngineFailure(Exception):
    """The engine failed while this request was in flight."""


@attrs.frozen
class ChoiceDelta:
    """New text of one choice; `finish_reason` is set on the choice's last delta."""

    index: int
    text: str
    finish_reason: str | None


class TextStreamer:
    """Text deltas of one choice. The concatenated deltas equal the final text.

    Text ending in an incomplete UTF-8 sequence is held back, and so are the last
    (longest stop string - 1) characters, which a stop string completed by the next
    token could still claim: a stop string never reaches the client.
    """

    def __init__(self, tokenizer: Any, stop: Seq[str]) -> None:
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self.token_ids: list[int] = []
        self.emitted = ""

    def feed(self, new_token_ids: Seq[int], output: RequestOutput | None) -> str:
        """The text to send now for these new tokens (and the finished output, if any)."""
        self.token_ids.extend(new_token_ids)
        if output is not None:
            text = self.final_text(output)
        elif self._tokenizer is None:
            return ""
        else:
            text = self._tokenizer.decode(self.token_ids)
            if text.endswith("\ufffd"):
                return ""
            text = text[: max(0, len(text) - self._holdback)]
        delta = text[len(self.emitted):]
        self.emitted += delta
        return delta

    def final_text(self, output: RequestOutput) -> str:
        """The output's text, cut before the earliest stop string when one ended it."""
        if self._tokenizer is None:
            return ""
        text = self._tokenizer.decode(list(output.token_ids))
        if output.finish_reason == "stop" and self._stop:
            found = [at for at in (text.find(s) for s in self._stop) if at >= 0]
            if found:
                text = text[: min(found)]
        return text


@attrs.define
class Choice:
    """One choice's engine request and what it has produced."""

    index: int
    prompt_index: int
    request_id: str
    streamer: TextStreamer
    output: RequestOutput | None = None

    @property
    def text(self) -> str:
        return self.streamer.emitted

    @property
    def finish_reason(self) -> str | None:
        return self.output.finish_reason if self.output is not None else None


class Generation:
    """The engine requests behind one HTTP request, and their deltas."""

    def __init__(self, engine: AsyncEngine, tokenizer: Any, prompts: Seq[Any], params: SamplingParams, n: int,
                 request_id: str, endpoint: str) -> None:
        self.engine = engine
        self.request_id = request_id
        self.endpoint = endpoint
        self.created = int(time.time())
        self._prompts = list(prompts)
        self._params = params
        self.choices = [Choice(p * n + i, p, f"{request_id}-{p * n + i}", TextStreamer(tokenizer, params.stop))
                        for p in range(len(prompts)) for i in range(n)]
        self._n = n
        self._events = None

    async def start(self, arrival_time: float) -> None:
        """Queue every choice in the engine (RequestError / EngineUnavailable propagate)."""
        requests = [NewRequest(c.request_id, self._prompts[c.prompt_index], self._choice_params(c), arrival_time)
                    for c in self.choices]
        self._events = await self.engine.add(requests)

    def _choice_params(self, choice: Choice) -> SamplingParams:
        seed = self._params.seed
        if seed is None or self._n == 1:
            return self._params
        return attrs.evolve(self._params, seed=seed + choice.index % self._n)

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        """Every choice's text deltas as the engine produces them, until all have finished.

        Events that queued up while the client was being served (a slow reader, a busy
        event loop) are merged: one delta per choice for all of them, not one per step.
        """
        by_request = {c.request_id: c for c in self.choices}
        unfinished = set(by_request)
        status = "aborted"
        try:
            while unfinished:
                for request_id, (token_ids, output) in (await self._next_events()).items():
                    choice = by_request[request_id]
                    text = choice.streamer.feed(token_ids, output)
                    if output is not None:
                        choice.output = output
                        unfinished.discard(request_id)
                    if text or output is not None:
                        yield ChoiceDelta(choice.index, text, choice.finish_reason)
            status = "ok"
        except EngineFailure:
            unfinished.clear()  # the engine dropped them already
            status = "failed"
            raise
        finally:
            if unfinished:
                self.engine.abort(unfinished)
            self._log(status)

    async def _next_events(self) -> dict[str, tuple[list[int], RequestOutput | None]]:
        """The next event and every one already queued, merged per request (in order)."""
        events = [await self._events.get()]
        while not self._events.empty():
            events.append(self._events.get_nowait())
        merged: dict[str, tuple[list[int], RequestOutput | None]] = {}
        for request_id, event in events:
            if event.error is not None:
                raise EngineFailure(event.error)
            token_ids, _ = merged.setdefault(request_id, ([], None))
            token_ids.extend(event.new_token_ids)
            merged[request_id] = (token_ids, event.output)
        return merged

    def usage(self) -> dict[str, int]:
        """OpenAI usage: prompt tokens once per prompt, completion tokens of every choice."""
        prompt_tokens = {}
        completion_tokens = 0
        for choice in self.choices:
            if choice.output is not None:
                prompt_tokens[choice.prompt_index] = len(choice.output.prompt_token_ids)
                completion_tokens += len(choice.output.token_ids)
            else:
                completion_tokens += len(choice.streamer.token_ids)
        total_prompt = sum(prompt_tokens.values())
        return {"prompt_tokens": total_prompt, "completion_tokens": completion_tokens,
                "total_tokens": total_prompt + completion_tokens}

    def _log(self, status: str) -> None:
        usage = self.usage()
        ttfts = [c.output.metrics.ttft for c in self.choices if c.output is not None and c.output.metrics.ttft]
        logger.info("request.finished", request_id=self.request_id, endpoint=self.endpoint, status=status,
                    choices=len(self.choices), prompt_tokens=usage["prompt_tokens"],
                    completion_tokens=usage["completion_tokens"],
                    finish_reasons=sorted({str(c.finish_reason) for c in self.choices}),
                    ttft_ms=round(min(ttfts) * 1000, 2) if ttfts else None)

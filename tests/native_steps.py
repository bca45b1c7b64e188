"""Which steps the cpu-paged backend's one-call native decoder ran, for tests that run the
same requests with it on and off."""

from __future__ import annotations

from typing import Any


def watch_native_steps(llm: Any, steps: list[tuple[bool, bool]], native: bool) -> None:
    """Append (native, whether the native decoder ran it) to `steps` for every step the
    engine asks the native decoder to run."""
    backend = llm.engine.runner.backend
    forward = backend.decoder_forward

    def counted(*args):
        selected = forward(*args)
        steps.append((native, selected is not None))
        return selected

    backend.decoder_forward = counted


def tokens_and_logprobs(outputs: list[Any]) -> list[tuple[list[int], list[dict[int, float]]]]:
    """Each request's first completion: its tokens and, per position, its logprobs."""
    return [(o.outputs[0].token_ids, [{t: p.logprob for t, p in position.items()} for position in o.outputs[0].logprobs])
            for o in outputs]

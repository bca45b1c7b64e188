"""`servelab generate`: one prompt streamed to stdout, or several prompts run as one batch.

Prompts come from repeated `--prompt` options and from a prompts file: one prompt per
line, blank lines skipped; a line written as a JSON string ("...") is decoded, so a
prompt can hold newlines or tabs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from servelab.arrivals import NOW, Arrival, serve_arrivals
from servelab.config import EngineConfig
from servelab.errors import ServelabError
from servelab.outputs import RequestOutput
from servelab.request import RequestSpec
from servelab.sampling_params import SamplingParams


def read_prompts_file(path: str) -> list[str]:
    """The prompts in `path`: one per non-blank line, JSON string lines decoded."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ServelabError(f"cannot read prompts file {path!r}: {exc.strerror}") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if line.startswith('"'):
            try:
                line = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ServelabError(f"{path}:{number}: not a JSON string: {exc.msg}") from None
        prompts.append(line)
    if not prompts:
        raise ServelabError(f"prompts file {path!r} holds no prompt")
    return prompts


def generate(config: EngineConfig, prompts: list[str], params: SamplingParams) -> None:
    """Run `prompts` to completion: text on stdout, a summary per prompt on stderr."""
    from servelab.engine import LLMEngine

    engine = LLMEngine(config)
    if engine.tokenizer is None:
        raise ServelabError(f"model {config.engine.model!r} has no tokenizer.json; cannot take a text prompt")
    records = engine.prepare_requests([RequestSpec(prompt, params) for prompt in prompts])  # all checked first
    if len(prompts) == 1:
        _stream_one(engine, records[0], params)
        return
    outputs: dict[int, RequestOutput] = {}

    def finished(arrival: Arrival[int], _engine: int, output: RequestOutput) -> None:
        outputs[arrival.item] = output

    serve_arrivals([engine], [Arrival(NOW, i) for i in range(len(prompts))],
                   lambda arrival: (0, engine.admit([records[arrival.item]])[0]), finished)
    for index in range(len(prompts)):
        output = outputs[index]
        print(f"--- prompt {index + 1}/{len(prompts)}: {json.dumps(output.prompt)}")
        print(output.text)
        print(_summary(output), file=sys.stderr)


def _stream_one(engine, record, params: SamplingParams) -> None:
    from servelab.detokenize import IncrementalText

    request_id = engine.admit([record])[0]
    text = IncrementalText(engine.tokenizer, params.stop)
    holdback = max(text.longest_stop - 1, 0)  # what a stop string completed later could still claim
    shown = 0
    while engine.has_unfinished():
        result = engine.step()
        event = result.events.get(request_id)
        text.append(event.new_token_ids if event is not None else ())
        for output in result.finished:
            sys.stdout.write(output.text[shown:] + "\n")
            print(_summary(output), file=sys.stderr)
        if not result.finished and len(text.text) - holdback > shown:
            sys.stdout.write(text.text[shown: len(text.text) - holdback])
            shown = len(text.text) - holdback
        sys.stdout.flush()


def _summary(output: RequestOutput) -> str:
    metrics = output.metrics
    spec = ""
    if metrics.num_draft_tokens:
        spec = (f", drafts accepted {metrics.num_accepted_tokens}/{metrics.num_draft_tokens}, "
                f"{output.mean_tokens_per_step:.2f} tokens per target step")
    return (f"[{len(output.token_ids)} tokens, finish_reason={output.finish_reason}, "
            f"ttft={metrics.ttft * 1000:.1f} ms, e2e={metrics.e2e_latency * 1000:.1f} ms{spec}]")

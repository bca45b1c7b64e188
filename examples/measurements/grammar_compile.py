"""How long xgrammar takes to compile a JSON schema over a real vocabulary (SmolLM2's 49,152
tokens by default), and what a request pays for it end to end.

    python examples/measurements/grammar_compile.py --model smollm2-135m --repeats 5

Three figures, each the median and min-max of `--repeats` runs:
- the tokenizer info (xgrammar's view of the vocabulary; built once per engine),
- compiling the schema with a fresh compiler (no cache), as the `structured` processor's
  compiler process does for a schema it has not seen,
- time to first token of a structured request minus that of the same request without a
  schema, both through `LLM.generate` (a new schema each run, so the engine's cache
  never answers).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{6}$"},
        "customer": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 40},
            "email": {"type": "string", "format": "email"},
            "tier": {"enum": ["free", "pro", "enterprise"]}}, "required": ["name", "email", "tier"]},
        "items": {"type": "array", "minItems": 1, "maxItems": 10, "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
            "price": {"type": "number", "minimum": 0}}, "required": ["sku", "quantity", "price"]}},
        "paid": {"type": "boolean"},
        "notes": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    },
    "required": ["order_id", "customer", "items", "paid"],
}


def tokenizer_info(tokenizer, vocab_size: int, eos_ids):
    """xgrammar's TokenizerInfo, built as the `structured` processor builds it."""
    import xgrammar as xgr

    backend = tokenizer.backend
    encoded = [""] * vocab_size
    for token, token_id in backend.get_vocab(with_added_tokens=True).items():
        if token_id < vocab_size:
            encoded[token_id] = token
    metadata = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
    return xgr.TokenizerInfo(encoded, metadata["vocab_type"], vocab_size=vocab_size, stop_token_ids=list(eos_ids),
                             add_prefix_space=metadata["add_prefix_space"])


def spread(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:.1f} ms ({min(values) * 1e3:.1f}-{max(values) * 1e3:.1f})"


def main() -> None:
    import xgrammar as xgr

    from servelab import LLM, SamplingParams, StructuredOutput

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    llm = LLM(args.model, max_model_len=512)
    config, tokenizer = llm.engine.source.model_config, llm.engine.source.tokenizer
    info_times, compile_times = [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        info = tokenizer_info(tokenizer, config.vocab_size, config.eos_token_ids)
        info_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        xgr.GrammarCompiler(info, cache_enabled=False).compile_json_schema(json.dumps(SCHEMA))
        compile_times.append(time.perf_counter() - start)

    prompt = tokenizer.encode("A JSON order:")
    llm.generate([prompt], SamplingParams(max_tokens=1))  # warm
    llm.generate([prompt], SamplingParams(max_tokens=1, structured=StructuredOutput.json(SCHEMA)))  # start the compiler
    extra = []
    for i in range(args.repeats):
        schema = {**SCHEMA, "title": f"order {i}"}  # not in the engine's grammar cache
        plain = llm.generate([prompt], SamplingParams(max_tokens=1))[0].metrics
        structured = llm.generate([prompt], SamplingParams(max_tokens=1, structured=StructuredOutput.json(schema)))[0]
        extra.append(_ttft(structured.metrics) - _ttft(plain))
    print(f"model {args.model}: vocabulary {config.vocab_size:,} tokens, {args.repeats} runs, median (min-max)")
    print(f"  xgrammar tokenizer info:                 {spread(info_times)}")
    print(f"  schema compile (fresh compiler):         {spread(compile_times)}")
    print(f"  first-token latency, structured - plain: {spread(extra)}")


def _ttft(metrics) -> float:
    return metrics.first_token_time - metrics.arrival_time


if __name__ == "__main__":
    main()

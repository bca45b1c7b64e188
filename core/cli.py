"""The `servelab` command: list plugins, generate text."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence as Seq

from servelab.config import EngineConfig
from servelab.errors import ServelabError
from servelab.logging_setup import configure_logging
from servelab.registry import PluginRegistry

EXIT_USAGE = 2


def main(argv: Seq[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    configure_logging(args.verbose)
    try:
        return args.handler(args)
    except ServelabError as exc:
        print(f"servelab: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="servelab", description="An LLM serving engine made of plugins.")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-v info, -vv debug)")
    commands = parser.add_subparsers(dest="command", required=True)

    plugins = commands.add_parser("plugins", help="list every installed policy by kind")
    plugins.add_argument("--json", action="store_true", help="machine-readable output")
    plugins.set_defaults(handler=_cmd_plugins)

    generate = commands.add_parser("generate", help="generate text for one prompt, streamed")
    _add_engine_arguments(generate)
    generate.add_argument("--prompt", required=True, help="the prompt text")
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=-1)
    generate.add_argument("--seed", type=int, default=None)
    generate.set_defaults(handler=_cmd_generate)

    bench = commands.add_parser("bench", help="throughput of a skewed offline workload, optionally vs transformers")
    _add_engine_arguments(bench)
    bench.add_argument("--num-requests", type=int, default=64)
    bench.add_argument("--mean-prompt-len", type=int, default=128)
    bench.add_argument("--mean-output-len", type=int, default=128)
    bench.add_argument("--seed", type=int, default=0, help="workload seed")
    bench.add_argument("--repeats", type=int, default=1, help="timed repetitions (the best is reported)")
    bench.add_argument("--baseline", choices=["hf"], help="also run transformers generate with static batches")
    bench.add_argument("--hf-batch-size", type=int, help="static batch size for the baseline (default max_num_seqs)")
    bench.add_argument("--json", dest="json_out", help="write the results as JSON to this file")
    bench.set_defaults(handler=_cmd_bench)
    return parser


def _add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="checkpoint directory or builtin:<name> (default: the config's, "
                                        "else builtin:tiny-random)")
    parser.add_argument("--config", help="TOML config file")
    parser.add_argument("--set", dest="assignments", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config value (repeatable), e.g. --set engine.max_num_seqs=8")


def load_config(args: argparse.Namespace) -> EngineConfig:
    config = EngineConfig.load(args.config).with_set_options(args.assignments)
    if args.model:
        config = config.with_overrides({"engine.model": args.model})
    return config


def _cmd_plugins(args: argparse.Namespace) -> int:
    listing = PluginRegistry.from_entry_points().describe()
    if args.json:
        print(json.dumps(listing, indent=2))
        return 0
    for kind, plugins in listing.items():
        print(f"{kind}:")
        if not plugins:
            print("  (none installed)")
        for plugin in plugins:
            print(f"  {plugin['name']:<20} {plugin['distribution']:<16} {plugin['description']}")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from servelab.sampling_params import SamplingParams

    config = load_config(args)  # config errors come before torch is even imported
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    from servelab.engine import LLMEngine
    from servelab.model.tokenizer import IncrementalDecoder

    engine = LLMEngine(config)
    if engine.tokenizer is None:
        raise ServelabError(f"model {config.engine.model!r} has no tokenizer.json; cannot take a text prompt")
    request_id = engine.add_request(args.prompt, params)
    decoder = IncrementalDecoder(engine.tokenizer)
    generated: list[int] = []
    while engine.has_unfinished():
        result = engine.step()
        generated.extend(result.new_token_ids.get(request_id, ()))
        sys.stdout.write(decoder.update(generated))
        sys.stdout.flush()
        for output in result.finished:
            sys.stdout.write("\n")
            print(f"[{len(output.token_ids)} tokens, finish_reason={output.finish_reason}, "
                  f"ttft={output.metrics.ttft * 1000:.1f} ms, e2e={output.metrics.e2e_latency * 1000:.1f} ms]",
                  file=sys.stderr)
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from servelab.bench import format_results, main_bench
    from servelab.workload import SkewedWorkload

    config = load_config(args)
    workload = SkewedWorkload(num_requests=args.num_requests, mean_prompt_len=args.mean_prompt_len,
                              mean_output_len=args.mean_output_len, seed=args.seed)
    results = main_bench(config, workload, args.baseline, args.repeats, args.hf_batch_size)
    print(format_results(results))
    if args.json_out:
        with open(args.json_out, "w") as handle:
            json.dump(results, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The `servelab` command: list plugins, generate text, benchmark, serve."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence as Seq

from servelab.bench.repetitions import DEFAULT_REPEATS
from servelab.config import WEIGHTS, EngineConfig
from servelab.expert_placement import PLACEMENT_POLICIES
from servelab.errors import ConfigError, ServelabError
from servelab.logging_setup import configure_logging
from servelab.kv_sizing import KV_CACHE_DTYPES
from servelab.registry import PluginRegistry
from servelab.server.options import add_serve_arguments, serve_options

EXIT_USAGE = 2


def main(argv: Seq[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(args.verbose)
    try:
        return args.handler(args)
    except ServelabError as exc:
        print(f"servelab: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


def parse_args(argv: Seq[str] | None = None) -> argparse.Namespace:
    """The command line, checked; a usage error exits with status 2 like argparse's own."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "generate" and not (args.prompts or args.prompts_file):
        parser.error("generate needs a prompt: --prompt TEXT (repeatable) or --prompts-file FILE")
    return args


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="servelab", description="An LLM serving engine made of plugins.")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-v info, -vv debug)")
    commands = parser.add_subparsers(dest="command", required=True)

    plugins = commands.add_parser("plugins", help="list every installed policy by kind")
    plugins.add_argument("--json", action="store_true", help="machine-readable output")
    plugins.set_defaults(handler=_cmd_plugins)

    generate = commands.add_parser("generate", help="generate text: one prompt streamed, or several batched")
    _add_engine_arguments(generate)
    generate.add_argument("--prompt", dest="prompts", action="append", default=[], metavar="TEXT",
                          help="a prompt (repeatable; several run as one batch, printed in order)")
    generate.add_argument("--prompts-file", metavar="FILE", help="more prompts, one per line "
                          '(a line written as a JSON string, "...", may hold \\n)')
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=-1)
    generate.add_argument("--seed", type=int, default=None)
    generate.set_defaults(handler=_cmd_generate)

    bench = commands.add_parser("bench", help="run a workload through several configs side by side")
    bench.add_argument("--config", dest="configs", action="append", default=[], metavar="FILE",
                       help="TOML config to compare (repeatable; default: the built-in defaults)")
    bench.add_argument("--model", help="model for every config (checkpoint directory, .gguf file, builtin:<name> "
                                       "or a named model such as smollm2-135m)")
    bench.add_argument("--set", dest="assignments", action="append", default=[], metavar="SECTION.KEY=VALUE",
                       help="override a value in every config (repeatable)")
    bench.add_argument("--workload", help="workload spec, e.g. 'skewed:num_requests=64' (the default: 'skewed'), "
                       "'shared-prefix:prefix_len=1000', 'skewed:arrival=poisson,rate=4', 'file:reqs.jsonl', "
                       "'mooncake:trace.jsonl,speedup=2,first=500', 'azure:trace.csv,every=10'; "
                       "with --calibrate, the one workload to fit and check (default: skewed, shared-prefix "
                       "and long-burst)")
    bench.add_argument("--repeats", type=int, help=f"interleaved timed repetitions; the median and min-max "
                       f"are reported (default {DEFAULT_REPEATS}; 1 with --sim, whose clock is deterministic)")
    bench.add_argument("--warm-cache", action="store_true", help="keep prefix caches between the warm-up "
                       "and the repetitions (default: every repetition starts from an empty cache)")
    bench.add_argument("--baseline", choices=["hf", "vllm", "llama.cpp"],
                       help="also run transformers generate with static batches (hf), or vLLM's offline LLM (vllm); "
                            "llama.cpp: the CPU table instead, servelab's int4/int8/fp32/bf16 against llama.cpp on "
                            "the same GGUF file (batch-1 TPOT and TTFT, 8 and 32 sequences' output tok/s)")
    bench.add_argument("--llama-cpp-bin", metavar="DIR",
                       help="for --baseline llama.cpp: the folder holding llama-bench and llama-batched-bench "
                            "(default $SERVELAB_LLAMA_CPP_BIN, then PATH, then llama-cpp-python)")
    bench.add_argument("--baseline-python", metavar="PATH",
                       help="for --baseline vllm: the Python of a virtual environment with vLLM installed")
    bench.add_argument("--hf-batch-size", type=int, help="static batch size for the baseline (default max_num_seqs)")
    bench.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="goodput SLO on time to first token")
    bench.add_argument("--slo-tpot-ms", type=float, default=200.0, help="goodput SLO on time per output token")
    bench.add_argument("--rates", help="comma-separated request rates (req/s) for a Poisson sweep")
    bench.add_argument("--disaggregate", action="append", default=[], metavar="xPyD",
                       help="compare one colocated engine against prefill/decode disaggregation with x prefill and "
                            "y decode engines in one process (repeatable: 1P1D, 2P1D, ...); with --sim, simulated "
                            "fleets against as many colocated replicas")
    bench.add_argument("--handoff-link", default="nvlink4", help="with --sim --disaggregate: the link a KV handoff "
                       "crosses: nvlink4, pcie5, pcie4, infiniband-ndr, infiniband-hdr, ethernet-100g, ethernet-25g")
    bench.add_argument("--json", dest="json_out", help="write the results as JSON to this file")
    bench.add_argument("--plots", dest="plots_dir", help="write PNG plots into this directory")
    bench.add_argument("--save-workload", help="write the generated workload as JSONL (replay with file:PATH)")
    bench.add_argument("--sim", metavar="ACCELERATOR", help="simulate instead of running the model: "
                       "h100, h200, a100, l4 (TensorRT-LLM-like, CUDA graphs; NAME-eager without) or cpu-here "
                       "(policies run unchanged against a per-kernel roofline cost model)")
    bench.add_argument("--calibrate", action="store_true",
                       help="fit the cpu-here simulator profile to real runs of the model (one thread, CPU time) "
                            "and report its error on held-out workloads, per kind")
    bench.add_argument("--threads", type=int, default=1,
                       help="with --calibrate: torch threads the engine runs with, fitted and checked at (default 1, "
                            "timed in CPU time; more are timed in wall-clock time)")
    bench.add_argument("--latency-requests", type=int, default=None, metavar="N",
                       help="with --calibrate: requests in each latency-under-arrivals case (default 120; "
                            "0: skip that check)")
    bench.add_argument("--sim-model", default="llama-3-8b",
                       help="model shape to simulate: llama-3-8b, llama-3-70b, qwen2-7b, tiny-random")
    bench.add_argument("--sim-interconnect", help="links between simulated devices under "
                       "engine.tensor_parallel_size > 1: nvlink4, nvlink3, pcie5, pcie4 (default: the accelerator's)")
    bench.add_argument("--replicas", type=int, default=1, help="with --sim: run each config as a fleet of N "
                       "replicas behind its [router] (default round-robin) and compare routers")
    bench.add_argument("--imbalance-factor", type=float, default=2.0, metavar="N",
                       help="with --replicas: warn when one replica takes more than N times its even share")
    _add_kv_cache_dtype_argument(bench)
    bench.set_defaults(handler=_cmd_bench)

    size = commands.add_parser("size", help="capacity plan on the simulator: KV blocks, concurrent sequences, "
                               "the rate one replica sustains under an SLO, replicas for a target rate, "
                               "speculative-decoding breakeven; TP x PP x EP layouts compared (--layouts G)")
    size.add_argument("--sim", required=True, metavar="ACCELERATOR", help="h100, h200, a100, l4 (or NAME-eager)")
    size.add_argument("--sim-model", default="llama-3-8b", help="model shape: llama-3-8b, llama-3-70b, qwen2-7b, "
                      "tiny-random, mixtral-8x7b (a mixture of experts)")
    size.add_argument("--tp", type=int, metavar="N", help="tensor parallelism: devices one replica spreads over "
                      "(sets engine.tensor_parallel_size; default: the config's, 1); with --ep N, the same N: "
                      "EP x TP on the same ranks (each holds its experts and its attention heads, vLLM's "
                      "--enable-expert-parallel)")
    size.add_argument("--pp", type=int, metavar="N", help="pipeline parallelism: stages the layers split into "
                      "(engine.pipeline_parallel_size; default: the config's, 1)")
    size.add_argument("--ep", type=int, metavar="N", help="expert parallelism: ranks a mixture of experts' experts "
                      "spread over (engine.expert_parallel_size; default: the config's, 1); --tp N --ep N: the same "
                      "N ranks also split the attention heads (N devices, not N x N)")
    size.add_argument("--layouts", type=int, metavar="G", help="compare every TP x PP (x EP) layout of G devices "
                      "the model admits, EP with attention TP on the same ranks (+TP-attn) included: memory, KV "
                      "capacity, priced decode and prefill, the best")
    size.add_argument("--expert-placement", help="EP's placement policy: linear, round_robin, balanced "
                      "(engine.expert_placement; default: the config's, linear)")
    size.add_argument("--expert-load", metavar="W,W,...", help="router load per expert, any scale, that EP's "
                      "imbalance is priced under (default: uniform)")
    size.add_argument("--chunk-sizing", default="fixed", help="how a prompt is cut into pipelined chunks: fixed, "
                      "equal_time (default fixed, as the engine cuts)")
    size.add_argument("--max-chunk", type=int, metavar="TOKENS", help="largest prefill chunk (default: a step's "
                      "tokens over engine.pipeline_micro_batches, one per stage)")
    size.add_argument("--sim-interconnect", help="links between the devices of a layout over several: nvlink4, "
                      "nvlink3, pcie5, pcie4 (default: the accelerator's)")
    size.add_argument("--context-len", type=int, default=4096, help="tokens a sequence may reach (max_model_len)")
    size.add_argument("--memory-utilization", type=float, default=0.9,
                      help="share of the memory weights and runtime leave that the KV pool takes (default 0.9)")
    size.add_argument("--config", help="TOML config for the scheduler and allocator (default: continuous, "
                      "paged, max_num_seqs 256)")
    size.add_argument("--set", dest="assignments", action="append", default=[], metavar="SECTION.KEY=VALUE",
                      help="override one config value (repeatable)")
    size.add_argument("--workload", default="fixed:num_requests=200,prompt_len=1024,output_len=256",
                      help="the traffic of the rate sweep (its arrival options are replaced by Poisson arrivals)")
    size.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    size.add_argument("--slo-tpot-ms", type=float, default=100.0)
    size.add_argument("--slo-attainment", type=float, default=0.9,
                      help="share of requests that must meet both bounds at a sustained rate (default 0.9)")
    size.add_argument("--target-rate", type=float, help="requests/s the fleet must sustain: prints replicas needed")
    size.add_argument("--no-sweep", action="store_true", help="memory and speculation only (no rate sweep)")
    size.add_argument("--sweep-seconds", type=float, default=60.0, help="each sweep point's requests arrive "
                      "over at least this long (default 60), so an unsustainable rate shows as a growing queue")
    size.add_argument("--acceptance-rate", type=float, default=0.7, help="draft token acceptance rate")
    size.add_argument("--draft-cost", type=float, help="one draft forward's time over one target decode step's "
                      "(default: measured on the cost model for --draft-model)")
    size.add_argument("--draft-model", default="tiny-random", help="draft model shape whose cost is measured")
    size.add_argument("--spec-batch", type=int, default=1, help="decode batch size of the speculation table")
    size.add_argument("--max-draft-tokens", type=int, default=6)
    size.add_argument("--json", dest="json_out", help="write the plan as JSON to this file")
    _add_kv_cache_dtype_argument(size)
    size.add_argument("--disaggregate", type=int, metavar="N", help="plan prefill/decode disaggregation instead: "
                      "every colocated fleet and xPyD split of 2..N devices, a tensor-parallel degree per role, on the "
                      "workload (give it arrivals, e.g. "
                      "arrival=poisson,rate=R), the best goodput per device meeting --slo-attainment")
    size.add_argument("--handoff-link", default="nvlink4", help="with --disaggregate: the link a KV handoff crosses")
    size.set_defaults(handler=_cmd_size)

    check = commands.add_parser("sim-check", help="the simulator against published GPU measurements: every "
                                "figure simulated and published, their ratio and error")
    check.add_argument("tables", choices=["published", "trtllm"],
                       help="published: vLLM 0.6.0 and SGLang 0.3.0 latency under load (Llama-3.1-8B on A100, "
                            "70B on 4 x H100), each engine modelled; trtllm: TensorRT-LLM's Llama-3.1-8B tables")
    check.add_argument("--scale", type=float, default=1.0,
                       help="with published: simulate this share of each run's prompts (default 1: all of them)")
    check.add_argument("--ablation", action="store_true",
                       help="with published: also each online 8B row's TPOT and TTFT under a TensorRT-LLM-like "
                            "engine, the engine's scheduler alone, and the full engine model")
    check.add_argument("--json", dest="json_out", help="write the rows as JSON to this file")
    check.set_defaults(handler=_cmd_sim_check)

    serve = commands.add_parser("serve", help="an OpenAI-compatible HTTP server (needs the serve extra)")
    serve.add_argument("model_path", nargs="?", metavar="MODEL", help="the model, as --model (vLLM's `serve MODEL`)")
    _add_engine_arguments(serve)
    add_serve_arguments(serve)
    serve.set_defaults(handler=_cmd_serve)
    return parser


def _add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="checkpoint directory, .gguf file, builtin:<name> or smollm2-135m "
                                        "(default: the config's, else builtin:tiny)")
    parser.add_argument("--config", help="TOML config file")
    parser.add_argument("--set", dest="assignments", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config value (repeatable), e.g. --set engine.max_num_seqs=8")
    parser.add_argument("--tensor-parallel-size", type=int, metavar="N",
                        help="shard the model over N ranks (engine.tensor_parallel_size; see README, Parallelism)")
    parser.add_argument("--expert-parallel-size", type=int, metavar="N",
                        help="spread a mixture-of-experts model's experts over N ranks (engine.expert_parallel_size; "
                             "docs/parallelism.md)")
    parser.add_argument("--expert-placement", choices=list(PLACEMENT_POLICIES),
                        help="how experts are placed over the ranks (engine.expert_placement; default linear)")
    parser.add_argument("--pipeline-parallel-size", type=int, metavar="N",
                        help="split the decoder's layers into N stages, one rank each (engine.pipeline_parallel_size; "
                             "docs/parallelism.md)")
    _add_kv_cache_dtype_argument(parser)
    parser.add_argument("--weights", choices=WEIGHTS,
                        help="keep the linear layers' weights quantized in memory: int8 or int4 (engine.weights; "
                             "default: the config's, dequantize)")


def _add_kv_cache_dtype_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES,
                        help="how the KV cache stores K/V (engine.kv_cache_dtype): auto (the model's dtype), or one "
                             "byte an element with a scale per token and head (docs/attention.md)")


def load_config(args: argparse.Namespace) -> EngineConfig:
    config = EngineConfig.load(args.config).with_set_options(args.assignments)
    if args.model:
        config = config.with_overrides({"engine.model": args.model})
    if args.tensor_parallel_size is not None:
        config = config.with_overrides({"engine.tensor_parallel_size": args.tensor_parallel_size})
    for option, key in (("expert_parallel_size", "engine.expert_parallel_size"),
                        ("expert_placement", "engine.expert_placement"),
                        ("pipeline_parallel_size", "engine.pipeline_parallel_size")):
        value = vars(args).get(option)
        if value is not None:
            config = config.with_overrides({key: value})
    if args.kv_cache_dtype is not None:
        config = config.with_overrides({"engine.kv_cache_dtype": args.kv_cache_dtype})
    if args.weights is not None:
        config = config.with_overrides({"engine.weights": args.weights})
    return config


def _cmd_plugins(args: argparse.Namespace) -> int:
    listing = PluginRegistry.from_entry_points().describe()
    if args.json:
        print(json.dumps(listing, indent=2))
        return 0
    clashes = []
    for kind, plugins in listing.items():
        print(f"{kind}:")
        if not plugins:
            print("  (none installed)")
        for plugin in plugins:
            marker = "*" if "clash" in plugin else ""
            print(f"  {plugin['name'] + marker:<20} {plugin['distribution']:<16} {plugin['description']}")
            if "clash" in plugin and plugin["clash"] not in clashes:
                clashes.append(plugin["clash"])
    if clashes:
        print("\nname clashes (*): select any policy by its qualified name, distribution:name")
        for clash in clashes:
            print(f"  {clash}")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from servelab.cli.generate import generate, read_prompts_file
    from servelab.sampling_params import SamplingParams

    config = load_config(args)  # config errors come before torch is even imported
    prompts = list(args.prompts) + (read_prompts_file(args.prompts_file) if args.prompts_file else [])
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    generate(config, prompts, params)
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    from servelab.bench.metrics import SLO
    from servelab.bench.report import format_table
    from servelab.bench.session import BenchOptions, run_bench

    configs = []
    for path in args.configs or [None]:
        config = EngineConfig.load(path).with_set_options(args.assignments)
        if args.model:
            config = config.with_overrides({"engine.model": args.model})
        if args.kv_cache_dtype is not None:
            config = config.with_overrides({"engine.kv_cache_dtype": args.kv_cache_dtype})
        configs.append((Path(path).stem if path else "default", config))
    names = [name for name, _ in configs]
    if len(set(names)) != len(names):
        raise ServelabError(f"config names must differ (they come from file names): {names}")
    options = BenchOptions(
        workload=args.workload or "skewed", repeats=_repeats(args), slo=SLO(args.slo_ttft_ms, args.slo_tpot_ms),
        baseline=args.baseline, hf_batch_size=args.hf_batch_size, baseline_python=args.baseline_python,
        plots_dir=Path(args.plots_dir) if args.plots_dir else None,
        rates=tuple(float(r) for r in args.rates.split(",")) if args.rates else (),
        save_workload=Path(args.save_workload) if args.save_workload else None,
        sim_accelerator=args.sim, sim_model=args.sim_model, sim_interconnect=args.sim_interconnect,
        warm_cache=args.warm_cache, replicas=args.replicas, imbalance_factor=args.imbalance_factor,
    )
    if args.baseline == "llama.cpp":
        return _cpu_table(args)
    if args.disaggregate:
        result = _disaggregated_bench(configs, args, options.slo)
    elif args.calibrate:
        result = _calibrate(configs[0][1], args.workload, args.threads, args.latency_requests,
                            SLO(args.slo_ttft_ms, args.slo_tpot_ms))
    else:
        result = run_bench(configs, options)
        print(format_table(result))
    if args.json_out:
        with open(args.json_out, "w") as handle:
            json.dump(result, handle, indent=2)
    return 0


def _disaggregated_bench(configs: list, args: argparse.Namespace, slo: object) -> dict:
    from servelab.bench.disaggregated import format_comparison, parse_topology, run_comparison

    topologies = [parse_topology(text) for text in args.disaggregate]
    if len(configs) != 1:
        raise ServelabError("--disaggregate compares one config colocated and disaggregated: give at most one --config")
    config = configs[0][1]
    if args.sim:
        from servelab.bench.sim.disaggregated import run_pd_comparison
        from servelab.bench.sim.shapes import model_shape
        from servelab.workload import build_workload

        workload = build_workload(args.workload or "skewed", model_shape(args.sim_model).vocab_size)
        result = run_pd_comparison(config, workload, topologies, args.sim, args.sim_model, args.handoff_link, slo)
    else:
        result = run_comparison(config, args.workload or "skewed:num_requests=16", topologies, slo)
    print(format_comparison(result))
    return result


def _cpu_table(args: argparse.Namespace) -> int:
    """`bench --baseline llama.cpp`: the CPU table (servelab.bench.cpu_table)."""
    from servelab.bench.cpu_table import format_cpu_table, run_cpu_table

    if not args.model:
        raise ServelabError("--baseline llama.cpp needs --model naming a GGUF file (or a named model such as "
                            "smollm2-135m): both engines read the same file")
    if args.sim or args.configs or args.rates:
        raise ServelabError("--baseline llama.cpp runs its own table on the real model: it takes --model, "
                            "--repeats, --llama-cpp-bin and --json, not --sim, --config or --rates")
    result = run_cpu_table(args.model, repeats=_repeats(args), llama_cpp_bin=args.llama_cpp_bin,
                           progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(format_cpu_table(result))
    if args.json_out:
        with open(args.json_out, "w") as handle:
            json.dump(result, handle, indent=2)
    return 0


def _repeats(args: argparse.Namespace) -> int:
    if args.repeats is not None:
        return args.repeats
    return 1 if args.sim else DEFAULT_REPEATS  # a simulated clock gives the same figures every time


def _cmd_size(args: argparse.Namespace) -> int:
    from servelab.bench.sim.size_command import size

    result = _plan_disaggregated(args) if args.disaggregate else size(args)
    if args.json_out:
        with open(args.json_out, "w") as handle:
            json.dump(result, handle, indent=2)
    return 0


def _plan_disaggregated(args: argparse.Namespace) -> dict:
    from servelab.bench.disaggregated import format_comparison
    from servelab.bench.metrics import SLO
    from servelab.bench.sim.disaggregated import plan_pd
    from servelab.bench.sim.shapes import model_shape
    from servelab.workload import build_workload

    if args.disaggregate < 2:
        raise ServelabError(f"--disaggregate {args.disaggregate}: a prefill and a decode engine need 2 devices or more")
    config = EngineConfig.load(args.config).with_set_options(args.assignments)
    workload = build_workload(args.workload, model_shape(args.sim_model).vocab_size)
    result = plan_pd(config, workload, args.sim, args.sim_model, args.handoff_link,
                     SLO(args.slo_ttft_ms, args.slo_tpot_ms), args.disaggregate, args.slo_attainment)
    print(format_comparison(result))
    print(f"best goodput per device meeting {args.slo_attainment:.0%} of the SLO: {result['best'] or 'none'}")
    return result


def _cmd_sim_check(args: argparse.Namespace) -> int:
    if not 0 < args.scale <= 1:
        raise ConfigError(f"--scale must be in (0, 1], got {args.scale}")
    progress = lambda text: print(text, file=sys.stderr)  # noqa: E731
    if args.tables == "trtllm":
        from servelab.bench.sim.fidelity import compare, format_rows

        result: dict = {"rows": compare()}
        print(format_rows(result["rows"]))
    else:
        from servelab.bench.sim import published

        result = {"rows": published.compare(scale=args.scale, progress=progress), "scale": args.scale}
        print(published.format_rows(result["rows"]))
        if args.ablation:
            result["ablation"] = published.ablation(args.scale, progress)
            print("\n" + published.format_ablation(result["ablation"]))
    if args.json_out:
        with open(args.json_out, "w") as handle:
            json.dump(result, handle, indent=2)
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from servelab.server.serve import run_server

    options = serve_options(args, os.environ)  # usage errors before the config is read
    return run_server(serving_config(args), options)


def serving_config(args: argparse.Namespace) -> EngineConfig:
    """The engine config `servelab serve` runs: the user's, sized for throughput where they
    left a size unset (servelab.server.serving_defaults)."""
    from servelab.server.serving_defaults import explicit_keys, with_serving_defaults

    if args.model_path is not None:
        if args.model is not None and args.model != args.model_path:
            raise ConfigError(f"two models given: {args.model_path!r} and --model {args.model!r}; give one")
        args.model = args.model_path
    config, explicit = load_config(args), explicit_keys(args.config, args.assignments)
    if args.dtype is not None:
        config = config.with_overrides({"engine.dtype": args.dtype})
        explicit.add("engine.dtype")
    return with_serving_defaults(config, explicit)


def serving_config_for(model: str, serve_arguments: Seq[str]) -> EngineConfig:
    """The engine config `servelab serve --model MODEL ARGUMENTS...` would run (for measurements
    that compare the server with offline runs of the same engine)."""
    return serving_config(parse_args(["serve", "--model", model, *serve_arguments]))


def _calibrate(config: EngineConfig, spec: str | None, threads: int = 1, latency_requests: int | None = 0,
               slo=None, repeats: int = 7, latency_cases: list | None = None) -> dict:
    """`bench --calibrate`: the offline step fit and its held-out check, then (unless
    `latency_requests` is 0) latency under arrivals on held-out rates and workloads."""
    from servelab.bench.metrics import SLO
    from servelab.bench.sim.calibrate import KINDS, calibrate, step_features
    from servelab.bench.sim.hardware import StepTerms
    from servelab.bench.sim.latency_check import LATENCY_REQUESTS, check_latency, default_cases, format_latency

    if latency_requests is None:
        latency_requests = LATENCY_REQUESTS
    if threads < 1 or latency_requests < 0:
        raise ConfigError(f"--threads must be >= 1 and --latency-requests >= 0, got {threads} and {latency_requests}")
    from servelab.model_source import CheckpointSource
    from servelab.workload import build_workload, parse_spec

    vocab_size = CheckpointSource(config.engine.model).model_config.vocab_size
    kinds = {parse_spec(spec)[0]: spec} if spec else KINDS
    fit_workloads, checks = [], {}
    for kind, kind_spec in kinds.items():
        name, options = parse_spec(kind_spec)
        if name in ("file", "mooncake", "azure"):
            raise ConfigError(f"--calibrate fits a generator's workload and checks it on the next seed; a {name}: "
                              "workload has one draw: name a generator (skewed, shared-prefix, ...)")
        seed = int(options.pop("seed", 0))
        fit_workloads.append(build_workload(_spec(name, {**options, "seed": seed}), vocab_size))
        checks[kind] = build_workload(_spec(name, {**options, "seed": seed + 1}), vocab_size)
    progress = lambda text: print(text, file=sys.stderr)  # noqa: E731
    result = calibrate(config, fit_workloads, checks, repeats=repeats, progress=progress, threads=threads)
    if latency_requests:
        cases = latency_cases or default_cases(latency_requests)
        result["latency"] = check_latency(config, StepTerms(**result["terms"]), step_features(config),
                                          cases, threads, slo or SLO(), progress)
    terms = result["terms"]
    timing = "one thread, CPU time" if threads == 1 else f"{threads} threads, wall-clock time"
    print(f"fitted cpu terms ({result['fit_steps']} steps, {timing}): "
          f"{1000 * terms['step_s']:.2f} ms a step + {1000 * terms['sequence_s']:.3f} ms a sequence; "
          f"GEMMs {_rate(terms['prefill_gemm_flop_s'])} GFLOP/s on prompt tokens, "
          f"{_rate(terms['decode_gemm_flop_s'])} on decode tokens; prefill attention "
          f"{_rate(terms['prefill_attention_flop_s'])} GFLOP/s; decode attention "
          f"{_rate(terms['decode_kv_byte_s'])} GB/s of KV; LM head {_rate(terms['lm_head_flop_s'])} GFLOP/s")
    print(f"held out (seed + 1), {timing}: measured = fastest of {result['repeats']} interleaved repetitions per step")
    print(f"{'workload':<14} {'median step ms (meas/pred)':>27} {'err':>6} {'output tok/s (meas/sim)':>24} {'err':>6} "
          f"{'repetitions tok/s':>18} {'wall tok/s':>10}")
    for kind, row in result["kinds"].items():
        step, throughput = row["median_step_ms"], row["throughput"]
        repeats = throughput["measured_repeats"]
        print(f"{kind:<14} {step['measured']:>13.2f} / {step['predicted']:<11.2f} {100 * step['error']:>5.1f}% "
              f"{throughput['measured']:>11.1f} / {throughput['simulated']:<10.1f} {100 * throughput['error']:>5.1f}% "
              f"{min(repeats):>8.0f}-{max(repeats):<9.0f} {throughput['measured_wall_clock']:>10.1f}")
    if "latency" in result:
        print(format_latency(result["latency"]))
    return result


def _spec(name: str, options: dict) -> str:
    return f"{name}:" + ",".join(f"{k}={v}" for k, v in options.items())


def _rate(seconds_per_unit: float) -> str:
    return "-" if seconds_per_unit <= 0 else f"{1e-9 / seconds_per_unit:.1f}"


if __name__ == "__main__":
    sys.exit(main())

"""Colocated against disaggregated (xPyD) serving on one workload, in real runs:
`servelab bench --disaggregate 1P1D [--disaggregate 2P1D ...]`.

Every topology runs the same requests (all arriving at the start) on the same config:
one colocated engine, then each xPyD deployment in one process (`DisaggregatedLLM`,
in-process transport). It reports goodput and SLO attainment under the bench's SLO,
TTFT and TPOT percentiles, and the KV bytes the handoffs moved. Engines in one Python
process take their steps in turn, so these runs measure the handoff's cost and the
output's identity, not the parallelism separate workers would add: that is the
simulator's (docs/disaggregation.md).
"""

from __future__ import annotations

import re
import time
from typing import Any, Sequence as Seq

from servelab.bench.metrics import SLO, percentiles
from servelab.config import EngineConfig
from servelab.errors import ConfigError
from servelab.outputs import RequestOutput
from servelab.sampling_params import SamplingParams
from servelab.workload import build_workload

_TOPOLOGY = re.compile(r"^(\d+)P(\d+)D$", re.IGNORECASE)


def parse_topology(text: str) -> tuple[int, int]:
    """"2P1D" -> (2, 1)."""
    match = _TOPOLOGY.match(text.strip())
    if match is None or int(match.group(1)) < 1 or int(match.group(2)) < 1:
        raise ConfigError(f"--disaggregate {text!r}: write prefill and decode engines as xPyD, e.g. 1P1D or 2P1D")
    return int(match.group(1)), int(match.group(2))


def summarize_outputs(name: str, outputs: Seq[RequestOutput], seconds: float, slo: SLO,
                      bytes_moved: float = 0.0, recomputes: float = 0.0) -> dict[str, Any]:
    """One topology's row: goodput (requests/s meeting both SLO bounds), attainment,
    TTFT/TPOT percentiles in ms, bytes moved."""
    ttft = [o.metrics.ttft for o in outputs if o.metrics.ttft is not None]
    tpot = [o.tpot for o in outputs if o.tpot is not None]
    good = sum(1 for o in outputs if o.finish_reason != "error" and o.metrics.ttft is not None
               and o.metrics.ttft * 1e3 <= slo.ttft_ms and (o.tpot is None or o.tpot * 1e3 <= slo.tpot_ms))
    ms = {key: (value * 1e3 if value is not None else None) for key, value in percentiles(ttft).items()}
    tpot_ms = {key: (value * 1e3 if value is not None else None) for key, value in percentiles(tpot).items()}
    return {"topology": name, "requests": len(outputs), "seconds": seconds,
            "goodput_rps": good / seconds if seconds > 0 else 0.0,
            "slo_attainment": good / len(outputs) if outputs else 0.0,
            "ttft_ms": ms, "tpot_ms": tpot_ms, "kv_bytes_moved": bytes_moved, "recomputes": recomputes,
            "errors": sum(1 for o in outputs if o.finish_reason == "error")}


def run_comparison(config: EngineConfig, workload: str, topologies: Seq[tuple[int, int]], slo: SLO
                   ) -> dict[str, Any]:
    """Colocated, then each topology, on the requests of the `workload` spec; rows in that
    order, and whether every topology's tokens equal the colocated engine's (greedy)."""
    from servelab.disagg.llm import DisaggregatedLLM
    from servelab.llm import LLM

    if config.allocator.name not in ("hash", "radix"):
        config = config.with_overrides({"allocator.name": "hash"})  # the same prefix cache on every side
    rows = []
    llm = LLM(config=config)
    try:
        requests = build_workload(workload, llm.engine.model_config.vocab_size).requests
        prompts = [list(r.prompt_token_ids) for r in requests]
        params = [SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True) for r in requests]
        started = time.perf_counter()
        reference = llm.generate(prompts, params)
        rows.append(summarize_outputs("colocated", reference, time.perf_counter() - started, slo))
    finally:
        llm.close()
    identical = {}
    for prefill, decode in topologies:
        name = f"{prefill}P{decode}D"
        with DisaggregatedLLM(config=config, prefill_engines=prefill, decode_engines=decode,
                              clock=time.perf_counter) as deployment:
            started = time.perf_counter()
            outputs = deployment.generate(prompts, params)
            seconds = time.perf_counter() - started
            metrics = deployment.metrics()
        rows.append(summarize_outputs(name, outputs, seconds, slo, metrics["decode"]["bytes"],
                                      metrics["decode"]["recomputes"]))
        identical[name] = [o.token_ids for o in outputs] == [o.token_ids for o in reference]
    return {"slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms}, "rows": rows, "identical": identical}


def format_comparison(result: dict[str, Any]) -> str:
    def number(value: Any, digits: int = 1) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    slo = result["slo"]
    width = max([10, *(len(row["topology"]) for row in result["rows"])])
    lines = [f"SLO: TTFT <= {slo['ttft_ms']:g} ms, TPOT <= {slo['tpot_ms']:g} ms",
             f"{'topology':<{width}} {'goodput/s':>9} {'SLO ok':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} "
             f"{'TPOT p99':>9} {'KV MB':>8} {'recomp':>6} {'same tokens':>11} {'goodput/device':>14}"]
    for row in result["rows"]:
        same = result["identical"].get(row["topology"])
        lines.append(f"{row['topology']:<{width}} {number(row['goodput_rps'], 2):>9} {row['slo_attainment']:>7.0%} "
                     f"{number(row['ttft_ms']['p50']):>9} {number(row['ttft_ms']['p99']):>9} "
                     f"{number(row['tpot_ms']['p50']):>9} {number(row['tpot_ms']['p99']):>9} "
                     f"{row['kv_bytes_moved'] / 1e6:>8.2f} {row['recomputes']:>6.0f} "
                     f"{'-' if same is None else ('yes' if same else 'NO'):>11} "
                     f"{number(row['goodput_per_device'] if 'goodput_per_device' in row else None, 2):>14}")
    return "\n".join(lines)

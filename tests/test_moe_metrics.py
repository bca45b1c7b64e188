"""Per-layer expert-load histograms are a first-class metric: the runner's totals, the
bench JSON's per-run histogram with its imbalance, and /metrics' gauges."""

from __future__ import annotations

import asyncio

import pytest

from servelab import LLM, SamplingParams
from servelab.bench.metrics import SLO
from servelab.bench.session import BenchOptions, run_bench
from servelab.config import EngineConfig
from servelab.expert_load import expert_load_of, imbalance, load_histograms


def test_load_histograms_are_what_a_run_added():
    before, after = {0: [1, 2, 3]}, {0: [1, 6, 5], 2: [4, 0, 0]}
    assert load_histograms(before, after) == {"0": {"counts": [0, 4, 2], "imbalance": 2.0},
                                              "2": {"counts": [4, 0, 0], "imbalance": 3.0}}
    assert imbalance([0, 0]) is None and imbalance([2, 2]) == 1.0


def test_a_dense_runner_reports_no_expert_load(llama_checkpoint):
    assert expert_load_of(LLM(llama_checkpoint, max_model_len=64).engine.runner) == {}


def test_the_bench_reports_each_layers_histogram(checkpoint_factory):
    config = EngineConfig().with_overrides({"engine.model": checkpoint_factory("qwen2_moe"),
                                            "engine.max_model_len": 128})
    options = BenchOptions(workload="skewed:num_requests=3,mean_prompt_len=10,mean_output_len=4,max_len=32",
                           repeats=1, slo=SLO(ttft_ms=1e9, tpot_ms=1e9))
    run = run_bench([("moe", config)], options)["runs"][0]
    metrics = run["metrics"]
    histograms = metrics["expert_load"]
    assert sorted(histograms) == ["0", "2"]  # layer 1 is dense (mlp_only_layers)
    first = histograms["0"]
    assert len(first["counts"]) == 7
    # every computed token of the run (prompt and decode rows, each of the run's requests)
    # took top_k=3 experts at the first layer
    computed = sum(r["prompt_tokens"] + r["output_tokens"] - 1 for r in run["requests"])
    assert sum(first["counts"]) == 3 * computed
    assert first["imbalance"] >= 1.0


def test_metrics_export_the_expert_load(checkpoint_factory):
    import httpx

    from servelab.server.app import ServerState, build_app
    from servelab.server.chat import ChatTemplate
    from servelab.server.codec import TextCodec
    from servelab.server.engine_loop import AsyncEngine, ThreadConnection
    from servelab.server.metrics import ServerMetrics

    engine = LLM(checkpoint_factory("mixtral"), max_model_len=64).engine
    metrics = ServerMetrics()
    state = ServerState(engine=AsyncEngine(ThreadConnection(engine), metrics.observe, on_failure=lambda exc: None),
                        metrics=metrics, codec=TextCodec(None, ChatTemplate(None)), model_name="moe",
                        max_model_len=64, max_waiting=8)

    async def scenario():
        state.engine.start()
        transport = httpx.ASGITransport(app=build_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://moe") as client:
            done = await client.post("/v1/completions", json={"prompt": [5, 6, 7, 8], "max_tokens": 3})
            scraped = await client.get("/metrics")
        await state.engine.shutdown()
        return done, scraped.text

    done, text = asyncio.run(asyncio.wait_for(scenario(), 20))
    assert done.status_code == 200, text
    samples = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
               if line.startswith("servelab_expert_load")}
    layer0 = [samples[f'servelab_expert_load{{expert="{e}",layer="0"}}'] for e in range(5)]
    assert sum(layer0) == 2 * (4 + 2)  # four prompt tokens and two decode steps, top-2
    assert samples['servelab_expert_load_imbalance{layer="0"}'] >= 1.0

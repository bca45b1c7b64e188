"""Prometheus metrics for `GET /metrics`.

Gauges come from the engine loop's latest snapshot (read at scrape time); histograms and
counters are fed by the requests' events on the event loop, step and draft totals by the
snapshots (or, for an engine in this process, by an engine observer on
`servelab_step_finished`), speculative acceptance among them. Each
server owns its own `CollectorRegistry`: nothing is global.

The figures vLLM also exports are exported under vLLM's names too (`vllm:num_requests_running`
and so on, labelled `model_name`, `VLLM_NAMES`), so dashboards built for vLLM work unchanged.
"""

from __future__ import annotations

import math
from typing import Any

import servelab
from servelab.expert_load import imbalance
from servelab.server.engine_loop import EngineSnapshot, Events

# Latency buckets (seconds) wide enough for a tiny CPU model and a real GPU one.
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5,
                    5.0, 10.0, 20.0, 40.0, 80.0)
_TOKEN_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                  0.75, 1.0, 2.5)


# servelab's metric -> vLLM's name for the same figure (and a label renamed, where vLLM's differs)
VLLM_NAMES = {
    "servelab_requests_running": "vllm:num_requests_running",
    "servelab_requests_waiting": "vllm:num_requests_waiting",
    "servelab_kv_cache_usage_ratio": "vllm:kv_cache_usage_perc",  # a fraction, despite the name (as vLLM's)
    "servelab_time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "servelab_time_per_output_token_seconds": "vllm:time_per_output_token_seconds",
    "servelab_e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    "servelab_generation_tokens": "vllm:generation_tokens",
    "servelab_prompt_tokens": "vllm:prompt_tokens",
    "servelab_requests_finished": "vllm:request_success",
    "servelab_preemptions": "vllm:num_preemptions",
}
_VLLM_LABELS = {"finish_reason": "finished_reason"}


class VllmNames:
    """A collector that re-exports ServerMetrics' figures under vLLM's names."""

    def __init__(self, metrics: "ServerMetrics", model_name: str) -> None:
        self._metrics = metrics
        self._model_name = model_name

    def collect(self) -> Any:
        from prometheus_client.core import Metric

        for collector in self._metrics.sources():
            for family in collector.collect():
                name = VLLM_NAMES.get(family.name)
                if name is None:
                    continue
                kind = "counter" if family.name == "servelab_preemptions" else family.type
                renamed = Metric(name, family.documentation, kind)
                for sample in family.samples:
                    if kind == "counter" and sample.name.endswith("_created"):
                        continue
                    suffix = sample.name[len(family.name):]
                    if family.name == "servelab_preemptions":
                        suffix = "_total"
                    labels = {_VLLM_LABELS.get(k, k): v for k, v in sample.labels.items()}
                    renamed.add_sample(name + suffix, {"model_name": self._model_name, **labels}, sample.value)
                yield renamed


# A disaggregated server's transfer counters (servelab.disagg.metrics.TransferMetrics), per role and replica:
# name in TransferMetrics -> (metric name, kind, help)
TRANSFER_METRICS = {
    "transfers": ("servelab_kv_transfers", "counter", "KV handoffs offered (prefill) or loaded (decode)."),
    "bytes": ("servelab_kv_transfer_bytes", "counter", "KV block bytes saved (prefill) or loaded (decode)."),
    "transfer_seconds": ("servelab_kv_transfer_seconds", "counter",
                         "Seconds spent in the KV data path and transport."),
    "blocks_skipped": ("servelab_kv_transfer_blocks_skipped", "counter",
                       "Decode: handed-over blocks its own prefix cache already held (not moved)."),
    "leases_expired": ("servelab_kv_transfer_leases_expired", "counter",
                       "Prefill: holds freed because their lease lapsed."),
    "rejects": ("servelab_kv_transfer_rejects", "counter", "Decode: handoffs rejected before admission."),
    "recomputes": ("servelab_kv_transfer_recomputes", "counter",
                   "Decode: requests whose KV was computed again (failure policy recompute)."),
    "failures": ("servelab_kv_transfer_failures", "counter",
                 "Requests ended with an error by the failure policy fail."),
    "held_blocks": ("servelab_kv_transfer_held_blocks", "gauge", "Prefill: KV blocks held for decode replicas now."),
}


class TransferCounters:
    """A collector of the transfer counters each prefill and decode replica last reported."""

    def __init__(self, metrics: "ServerMetrics") -> None:
        self._metrics = metrics

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        source = self._metrics.transfer_source
        if source is None:
            return
        reports = source()
        for key, (name, kind, documentation) in TRANSFER_METRICS.items():
            family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(
                name, documentation, labels=["role", "replica"])
            for role, replica, counters in reports:
                family.add_metric([role, replica], float(counters.get(key, 0)))
            yield family


class ServerMetrics:
    """Every metric the server exports, on a registry of its own."""

    def __init__(self, model_name: str = "") -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        r = self.registry
        self.requests_running = Gauge("servelab_requests_running", "Sequences in the running batch.", registry=r)
        self.requests_waiting = Gauge("servelab_requests_waiting", "Sequences queued for admission.", registry=r)
        self.kv_usage = Gauge("servelab_kv_cache_usage_ratio", "Fraction of KV blocks in use (0-1).", registry=r)
        self.kv_blocks = Gauge("servelab_kv_blocks", "KV cache blocks by state.", ["state"], registry=r)
        self.kv_bytes_per_token = Gauge("servelab_kv_cache_bytes_per_token",
                                        "Bytes of K and V of every layer one token takes in the KV cache, by "
                                        "[engine] kv_cache_dtype.", ["kv_cache_dtype"], registry=r)
        self.prefix_hit_rate = Gauge("servelab_prefix_cache_hit_rate",
                                     "Prompt tokens found in the prefix cache / prompt tokens looked up "
                                     "(NaN before any lookup).", registry=r)
        self.acceptance_rate = Gauge("servelab_spec_decode_acceptance_rate",
                                     "Accepted / proposed draft tokens (NaN before any draft).", registry=r)
        self.preemptions = Gauge("servelab_preemptions", "Preemptions since start.", registry=r)
        self.tier_blocks = Gauge("servelab_kv_tier_blocks", "KV blocks per tier and state ([kv_offload]).",
                                 ["tier", "state"], registry=r)
        self.tier_moves = Gauge("servelab_kv_tier_moves", "Block moves between tiers since start, by kind.",
                                ["kind"], registry=r)
        self.tier_moves_last_step = Gauge("servelab_kv_tier_moves_last_step", "Block moves in the last step.",
                                          registry=r)
        self.tier_bytes_moved = Gauge("servelab_kv_tier_bytes_moved", "Bytes moved between tiers since start.",
                                      registry=r)
        self.ttft = Histogram("servelab_time_to_first_token_seconds", "Arrival to first generated token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("servelab_time_per_output_token_seconds",
                              "Mean time between output tokens after the first, per request.",
                              buckets=_TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("servelab_e2e_request_latency_seconds", "Arrival to the last token.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.expert_load = Gauge("servelab_expert_load", "(Token, expert) assignments each expert of each sparse "
                                 "layer took since start (mixture-of-experts models).", ["layer", "expert"],
                                 registry=r)
        self.expert_imbalance = Gauge("servelab_expert_load_imbalance", "The busiest expert's load over the mean "
                                      "expert's, per sparse layer (1: even).", ["layer"], registry=r)
        self.pipeline_bubble = Gauge("servelab_pipeline_bubble_fraction", "Under pipeline parallelism, the share "
                                     "of its time the first stage has waited on the rest of the pipeline.",
                                     registry=r)
        self.pipeline_stage_bubble = Gauge("servelab_pipeline_stage_bubble_fraction", "Under pipeline "
                                           "parallelism, the share of its time each stage has waited for its "
                                           "input.", ["stage"], registry=r)
        self.generation_tokens = Counter("servelab_generation_tokens", "Tokens generated.", registry=r)
        self.prompt_tokens = Counter("servelab_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.finished = Counter("servelab_requests_finished", "Completions finished, by finish reason.",
                                ["finish_reason"], registry=r)
        self.rejected = Counter("servelab_http_requests_rejected", "HTTP requests refused, by reason.",
                                ["reason"], registry=r)
        self.steps = Counter("servelab_engine_steps", "Engine steps run.", registry=r)
        # With replicas (`--replicas N`), the gauges above are sums over replicas, and these are per replica.
        self.replica_up = Gauge("servelab_replica_up", "1 while the replica serves, 0 while it is out of rotation "
                                "(failed, or silent past the liveness timeout).",
                                ["replica"], registry=r)
        self.replica_running = Gauge("servelab_replica_requests_running", "Sequences in the replica's batch.",
                                     ["replica"], registry=r)
        self.replica_waiting = Gauge("servelab_replica_requests_waiting", "Sequences queued in the replica.",
                                     ["replica"], registry=r)
        self.replica_kv_used = Gauge("servelab_replica_kv_blocks_used", "KV blocks the replica holds.",
                                     ["replica"], registry=r)
        self.replica_prefix_hit_rate = Gauge("servelab_replica_prefix_cache_hit_rate",
                                             "The replica's prefix-cache hit rate (NaN before any lookup).",
                                             ["replica"], registry=r)
        self.replica_tokens = Counter("servelab_replica_generation_tokens", "Tokens the replica generated.",
                                      ["replica"], registry=r)
        self.replica_failed_over = Counter("servelab_requests_failed_over", "Requests routed again because the "
                                           "replica they waited on stopped answering, by that replica.",
                                           ["replica"], registry=r)
        self.replica_routed = Counter("servelab_replica_requests_routed", "Requests the router sent to the replica.",
                                      ["replica"], registry=r)
        self._sources = [self.requests_running, self.requests_waiting, self.kv_usage, self.ttft, self.tpot, self.e2e,
                         self.generation_tokens, self.prompt_tokens, self.finished, self.preemptions]
        r.register(VllmNames(self, model_name))
        # With prefill and decode replicas: () -> [(role, replica, that replica's transfer counters)]
        self.transfer_source: Any = None
        r.register(TransferCounters(self))
        self._replicas: dict[int, EngineSnapshot] = {}
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self._snapshot: EngineSnapshot | None = None
        self._totals_seen = (0, 0, 0)  # steps, draft and accepted tokens counted so far

    # Called on the event loop for every engine-loop iteration.
    def observe(self, events: Events, snapshot: EngineSnapshot) -> None:
        self._snapshot = snapshot
        self._count_steps(snapshot)
        num_new = 0
        for event in events.values():
            num_new += len(event.new_token_ids)
            if event.output is not None:
                self._observe_finished(event.output)
        if num_new:
            self.generation_tokens.inc(num_new)

    def _count_steps(self, snapshot: EngineSnapshot) -> None:
        """Step and draft totals come with each snapshot (the engine runs in another process)."""
        steps, drafted, accepted = self._totals_seen
        if snapshot.num_steps <= steps:
            return
        self.steps.inc(snapshot.num_steps - steps)
        self.num_draft_tokens += snapshot.num_draft_tokens - drafted
        self.num_accepted_tokens += snapshot.num_accepted_tokens - accepted
        self._totals_seen = (snapshot.num_steps, snapshot.num_draft_tokens, snapshot.num_accepted_tokens)

    def _observe_finished(self, output: Any) -> None:
        metrics = output.metrics
        for completion in output.outputs:
            self.finished.labels(completion.finish_reason or "unknown").inc()
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        if metrics.first_token_time is None:
            return
        self.ttft.observe(metrics.first_token_time - metrics.arrival_time)
        if metrics.finish_time is not None:
            self.e2e.observe(metrics.finish_time - metrics.arrival_time)
            num_tokens = max(len(c.token_ids) for c in output.outputs)  # the longest of n completions
            if num_tokens > 1:
                self.tpot.observe((metrics.finish_time - metrics.first_token_time) / (num_tokens - 1))

    def observe_replica(self, index: int, events: Events, snapshot: EngineSnapshot) -> None:
        """One replica's step (called with the aggregate's `observe`)."""
        if index not in self._replicas:
            self.replica_up.labels(str(index)).set(1)
        self._replicas[index] = snapshot
        num_new = sum(len(event.new_token_ids) for event in events.values())
        if num_new:
            self.replica_tokens.labels(str(index)).inc(num_new)

    def routed(self, index: int) -> None:
        self.replica_routed.labels(str(index)).inc()

    def failed_over(self, index: int, num_requests: int) -> None:
        self.replica_failed_over.labels(replica=str(index)).inc(num_requests)

    def replica_down(self, index: int) -> None:
        self.replica_up.labels(str(index)).set(0)

    def replica_back(self, index: int) -> None:
        self.replica_up.labels(str(index)).set(1)

    def sources(self) -> list[Any]:
        """The metrics VllmNames renames."""
        return self._sources

    def reject(self, reason: str) -> None:
        self.rejected.labels(reason).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric, gauges refreshed first."""
        from prometheus_client import generate_latest

        if self._snapshot is not None:
            self._refresh_gauges(self._snapshot)
        for index, snapshot in self._replicas.items():
            label, kv = str(index), snapshot.allocator
            self.replica_running.labels(label).set(snapshot.scheduler.num_running)
            self.replica_waiting.labels(label).set(snapshot.scheduler.num_waiting)
            self.replica_kv_used.labels(label).set(kv.num_used_blocks)
            lookups = kv.prefix_lookup_tokens
            self.replica_prefix_hit_rate.labels(label).set(kv.prefix_hit_tokens / lookups if lookups else math.nan)
        drafted, accepted = self.num_draft_tokens, self.num_accepted_tokens
        self.acceptance_rate.set(accepted / drafted if drafted else math.nan)
        return generate_latest(self.registry)

    def _refresh_gauges(self, snapshot: EngineSnapshot) -> None:
        scheduler, kv = snapshot.scheduler, snapshot.allocator
        self.requests_running.set(scheduler.num_running)
        self.requests_waiting.set(scheduler.num_waiting + snapshot.num_preparing)
        self.preemptions.set(scheduler.num_preemptions)
        self.kv_usage.set(kv.num_used_blocks / kv.num_blocks if kv.num_blocks else 0.0)
        for state, count in (("total", kv.num_blocks), ("used", kv.num_used_blocks),
                             ("free", kv.num_free_blocks), ("cached", kv.num_cached_blocks)):
            self.kv_blocks.labels(state).set(count)
        lookups = kv.prefix_lookup_tokens
        self.prefix_hit_rate.set(kv.prefix_hit_tokens / lookups if lookups else math.nan)
        tier = snapshot.tier
        if tier is not None:
            for state, count in (("used", kv.num_used_blocks), ("free", kv.num_free_blocks),
                                 ("cached", kv.num_cached_blocks)):
                self.tier_blocks.labels("device", state).set(count)
            for state, count in (("free", tier.num_host_free), ("cached", tier.num_host_cached),
                                 ("swapped", tier.num_host_swapped)):
                self.tier_blocks.labels("host", state).set(count)
            for kind, count in (("offload", tier.num_offloads), ("load", tier.num_loads),
                                ("swap_out", tier.num_swap_outs), ("swap_in", tier.num_swap_ins)):
                self.tier_moves.labels(kind).set(count)
            self.tier_moves_last_step.set(tier.moves_last_step)
            self.tier_bytes_moved.set(tier.bytes_moved)
        if snapshot.pipeline_bubble is not None:
            self.pipeline_bubble.set(snapshot.pipeline_bubble)
        for stage, fraction in enumerate(snapshot.pipeline_stage_bubbles):
            if fraction is not None:
                self.pipeline_stage_bubble.labels(stage=str(stage)).set(fraction)
        for layer, counts in (snapshot.expert_load or {}).items():
            for expert, count in enumerate(counts):
                self.expert_load.labels(str(layer), str(expert)).set(count)
            ratio = imbalance(counts)
            self.expert_imbalance.labels(str(layer)).set(math.nan if ratio is None else ratio)


class EngineObserver:
    """An engine plugin (observer hooks only) feeding per-step numbers into ServerMetrics,
    for an engine in this process (the server's engine reports them in its snapshots).
    Draft counts come from the step report
    (`num_draft_tokens`, `num_accepted_tokens`); without a drafter they stay 0 and the
    acceptance rate is NaN.
    """

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    @servelab.hookimpl
    def servelab_step_finished(self, engine: Any, report: Any) -> None:
        self.metrics.steps.inc()
        self.metrics.num_draft_tokens += report.num_draft_tokens
        self.metrics.num_accepted_tokens += report.num_accepted_tokens

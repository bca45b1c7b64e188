"""Prefill/decode disaggregation in one process (servelab.disagg): output identical to one
colocated engine for every KV dtype, the data path bit for bit, the KV-aware P/D
router, the failure policies and the per-role metrics."""

from __future__ import annotations

import attrs
import pytest
import torch
from structlog.testing import capture_logs

from servelab import SamplingParams
from servelab.disagg.data_path import RunnerDataPath
from servelab.disagg.llm import DisaggregatedLLM
from servelab.errors import ConfigError, RequestError
from servelab.llm import LLM
from servelab.plugins.transports.in_process import InProcessTransport

PROMPTS = [list(range(5, 31)), list(range(5, 17)) + list(range(60, 75)), [9, 8, 7], list(range(40, 63))]


def config(checkpoint: str, **engine) -> dict:
    return {"engine": {"model": checkpoint, "block_size": 4, "num_kv_blocks": 96, "max_num_seqs": 4,
                       "max_model_len": 128, **engine}, "allocator": {"name": "hash"}}


def colocated(cfg: dict, params: list[SamplingParams]) -> list[list[int]]:
    llm = LLM(config=cfg)
    try:
        prompts = PROMPTS * (len(params) // len(PROMPTS))
        return [o.token_ids for o in llm.generate(prompts, params)]
    finally:
        llm.close()


GREEDY = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)] * len(PROMPTS)
SEEDED = [SamplingParams(max_tokens=6, temperature=0.9, top_p=0.95, seed=s, ignore_eos=True) for s in range(4)]


@pytest.mark.parametrize(("dtype", "kv_cache_dtype"), [("float32", "auto"), ("bfloat16", "auto"),
                                                       ("float32", "int8"), ("float32", "fp8_e4m3"),
                                                       ("float32", "fp8_e5m2")])
def test_output_equals_one_colocated_engine_for_every_kv_dtype(servelab_tiny_checkpoint, dtype, kv_cache_dtype):
    cfg = config(servelab_tiny_checkpoint, dtype=dtype, kv_cache_dtype=kv_cache_dtype)
    expected = colocated(cfg, GREEDY + SEEDED)
    with DisaggregatedLLM(config=cfg) as llm:
        outputs = llm.generate(PROMPTS * 2, GREEDY + SEEDED)
        assert [o.token_ids for o in outputs] == expected
        assert [o.prompt_token_ids for o in outputs] == PROMPTS * 2
        metrics = llm.metrics()
        assert metrics["decode"]["recomputes"] == 0 and metrics["decode"]["failures"] == 0
        assert metrics["prefill"]["transfers"] > 0 and metrics["decode"]["bytes"] > 0
        assert set(llm.leaked_blocks().values()) == {0}
        assert metrics["prefill"]["held_blocks"] == 0


def test_the_data_path_moves_blocks_bit_for_bit_with_their_scales(servelab_tiny_checkpoint):
    for kv_cache_dtype in ("auto", "int8", "fp8_e4m3"):
        cfg = config(servelab_tiny_checkpoint, kv_cache_dtype=kv_cache_dtype)
        source, target = LLM(config=cfg).engine, LLM(config=cfg).engine
        for pair in source.runner.kv_caches:  # random bytes in every block, scales included
            for cache in pair:
                raw = cache.view(torch.uint8)
                raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
        path_from = RunnerDataPath(source.runner, kv_cache_dtype, 4)
        path_to = RunnerDataPath(target.runner, kv_cache_dtype, 4)
        assert path_from.layout() == path_to.layout()
        assert path_from.layout().scales == ("none" if kv_cache_dtype == "auto" else "inline-row")
        data = path_from.save([3, 7, 1])
        assert len(data) == 3 and all(len(d) == path_from.layout().block_bytes for d in data)
        path_to.load([10, 2, 5], data)
        dim = source.runner.block_dim
        for (sk, sv), (tk, tv) in zip(source.runner.kv_caches, target.runner.kv_caches):
            for s, t in ((sk, tk), (sv, tv)):
                for a, b in ((3, 10), (7, 2), (1, 5)):
                    assert torch.equal(s.view(torch.uint8).select(dim, a), t.view(torch.uint8).select(dim, b))
        with pytest.raises(ValueError, match="bytes"):
            path_to.load([0], [data[0][:-1]])


def test_the_decode_engine_holding_the_prompt_is_chosen_and_loads_only_what_it_lacks(servelab_tiny_checkpoint):
    cfg = config(servelab_tiny_checkpoint)
    prompt = list(range(5, 37))
    with DisaggregatedLLM(config=cfg, prefill_engines=2, decode_engines=2) as llm:
        first = llm.generate([prompt], [GREEDY[0]])[0]
        warm = [i for i, w in enumerate(llm.decode) if w.metrics.transfers]
        assert len(warm) == 1
        bytes_before = llm.metrics()["decode"]["bytes"]
        again = llm.generate([prompt], [GREEDY[0]])[0]
        assert again.token_ids == first.token_ids
        # the second handoff went to the decode engine whose cache held the prompt, and moved no block
        assert llm.decode[warm[0]].metrics.blocks_skipped == len(prompt) // 4
        assert llm.metrics()["decode"]["bytes"] == bytes_before
        assert first.request_id != again.request_id and first.request_id.startswith("xfer-")


def test_recompute_is_counted_and_logged_never_silent(servelab_tiny_checkpoint):
    cfg = config(servelab_tiny_checkpoint)
    expected = colocated(cfg, GREEDY)

    class Dropping(InProcessTransport):
        def offer(self, handoff, payloads):
            pass  # nothing ever lands

    with DisaggregatedLLM(config=cfg, failure_policy="recompute", transport=Dropping()) as llm, \
            capture_logs() as logs:
        outputs = llm.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outputs] == expected
        recomputed = llm.metrics()["decode"]["recomputes"]
        assert recomputed == 3  # every prompt of at least one block
        assert sum(entry["event"] == "kv_transfer.recompute" and entry["log_level"] == "warning"
                   for entry in logs) == recomputed
    with DisaggregatedLLM(config=cfg, failure_policy="fail", transport=Dropping()) as llm:
        outputs = llm.generate(PROMPTS, GREEDY)
        failed = [o for o in outputs if o.finish_reason == "error"]
        assert len(failed) == 3 and all("unknown" in o.error for o in failed)
        assert llm.metrics()["decode"]["failures"] == 3


def test_a_reject_frees_the_producers_blocks_at_once(servelab_tiny_checkpoint):
    with DisaggregatedLLM(config=config(servelab_tiny_checkpoint), failure_policy="fail", lease_s=3600) as llm:
        llm.decode[0].admission = lambda handoff: "full"
        transfer_id = llm.add_request(PROMPTS[0], GREEDY[0])
        outputs = []
        for _ in range(3):
            outputs += llm.step()
        assert [o.request_id for o in outputs] == [transfer_id] and outputs[0].finish_reason == "error"
        assert "rejected before admission" in outputs[0].error
        assert llm.prefill[0].num_holds == 0 and set(llm.leaked_blocks().values()) == {0}
        assert llm.metrics()["decode"]["rejects"] == 1 and llm.metrics()["prefill"]["leases_expired"] == 0


def test_a_deployment_that_cannot_run_is_refused_by_name(servelab_tiny_checkpoint):
    with pytest.raises(ConfigError, match="failure policy"):
        DisaggregatedLLM(config=config(servelab_tiny_checkpoint), failure_policy="retry")
    with pytest.raises(ConfigError, match="at least one prefill"):
        DisaggregatedLLM(config=config(servelab_tiny_checkpoint), prefill_engines=0)


STORY = ["Once upon a time", "The cat sat on the", "def add(a, b):", "In the beginning there"]


def stop_cases(first_texts: list[str], texts: list[str]) -> list[list[str]]:
    """Per prompt, stop strings from its greedy text: one across the first token's text and
    the second's (the prefill replica generated the first), one inside the decode replica's
    tokens, one that never comes."""
    cases = []
    for first, text in zip(first_texts, texts):
        k = len(first)
        cases.append([text[max(k - 1, 0): k + 2]])  # spans the first token's end
        cases.append([text[k + 6: k + 9]])  # later, in decode's tokens
        cases.append(["\u2603 never"])
    return cases


def test_stop_strings_end_a_disaggregated_request_as_they_end_a_colocated_one():
    """Stop strings are matched over the whole output on the decode replica, the prefill
    replica's first token included (RequestSpec.continues): text, tokens, finish and stop
    reasons equal one colocated engine's, for a stop string across the two engines' tokens,
    one inside the decode replica's, and none."""
    cfg = config("builtin:tiny")
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    llm = LLM(config=cfg)
    try:
        plain = llm.generate(STORY, greedy)
        first_texts = [llm.engine.tokenizer.decode(o.token_ids[:1]) for o in plain]
        cases = stop_cases(first_texts, [o.text for o in plain])
        params = [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=stop) for stop in cases]
        prompts = [prompt for prompt in STORY for _ in range(3)]
        expected = llm.generate(prompts, params)
    finally:
        llm.close()
    assert sum(o.finish_reason == "stop" for o in expected) >= 6  # the cases do stop where they were taken
    spanning = [o for o in expected[::3] if o.finish_reason == "stop"]
    assert any(len(o.token_ids) <= 3 for o in spanning)  # at least one stop string crosses the handoff
    with DisaggregatedLLM(config=cfg) as disaggregated:
        outputs = disaggregated.generate(prompts, params)
        assert disaggregated.metrics()["prefill"]["transfers"] > 0
        disaggregated.step()  # the prefill engine frees the holds of transfers completed in the last step
        assert set(disaggregated.leaked_blocks().values()) == {0}
    assert [(o.token_ids, o.text, o.finish_reason, o.outputs[0].stop_reason) for o in outputs] == \
        [(o.token_ids, o.text, o.finish_reason, o.outputs[0].stop_reason) for o in expected]


def _ranks(output) -> list[dict[int, tuple[int, str | None]]]:
    return [{token: (lp.rank, lp.decoded_token) for token, lp in position.items()}
            for position in output.outputs[0].logprobs]


def _values(output) -> list[float]:
    return [lp.logprob for position in output.outputs[0].logprobs for _, lp in sorted(position.items())]


def test_logprobs_come_from_both_engines_as_from_one(servelab_tiny_checkpoint):
    """logprobs=k: the first position from the prefill engine, the rest from the decode
    engine, together one colocated engine's (greedy and seeded)."""
    cfg = config(servelab_tiny_checkpoint)
    params = [attrs.evolve(p, logprobs=2) for p in GREEDY + SEEDED]
    llm = LLM(config=cfg)
    try:
        expected = llm.generate(PROMPTS * 2, params)
    finally:
        llm.close()
    with DisaggregatedLLM(config=cfg) as disaggregated:
        outputs = disaggregated.generate(PROMPTS * 2, params)
        assert disaggregated.metrics()["prefill"]["transfers"] > 0
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    assert all(len(o.outputs[0].logprobs) == len(o.token_ids) for o in outputs)
    assert [_ranks(o) for o in outputs] == [_ranks(o) for o in expected]
    for got, want in zip(outputs, expected):  # each engine's batch differs from the colocated one's
        assert _values(got) == pytest.approx(_values(want), abs=1e-4)


def test_a_request_that_ends_in_its_first_decode_step_frees_the_blocks_it_loaded(servelab_tiny_checkpoint):
    """max_tokens=2: the decode engine loads the handoff and finishes in the same step; the
    blocks it loaded are freed with the request, not left pinned."""
    with DisaggregatedLLM(config=config(servelab_tiny_checkpoint)) as llm:
        outputs = llm.generate(PROMPTS, [SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)] * 4)
        assert [len(o.token_ids) for o in outputs] == [2] * 4 and llm.metrics()["prefill"]["transfers"] == 3
        assert [w.engine.allocator.stats().num_used_blocks for w in llm.decode] == [0]


def test_a_refused_prompt_refuses_the_call_and_leaves_nothing_running(servelab_tiny_checkpoint):
    """One prompt an engine refuses (longer than max_model_len) after good ones: generate
    raises naming it, the prompts added before it are aborted (nothing left running or held),
    and the next call is served as one engine serves it."""
    cfg = config(servelab_tiny_checkpoint)
    with DisaggregatedLLM(config=cfg) as llm:
        with pytest.raises(RequestError, match="max_model_len"):
            llm.generate([PROMPTS[0], PROMPTS[1], list(range(3, 203))], GREEDY[:3])
        assert not llm.has_unfinished()
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == colocated(cfg, GREEDY)
        assert set(llm.leaked_blocks().values()) == {0}


def test_a_request_whose_first_token_ends_it_never_reaches_decode(servelab_tiny_checkpoint):
    cfg = config(servelab_tiny_checkpoint)
    with DisaggregatedLLM(config=cfg) as llm:
        [output] = llm.generate([PROMPTS[0]], [SamplingParams(max_tokens=1, temperature=0)])
        assert len(output.token_ids) == 1 and output.finish_reason == "length"
        assert llm.metrics()["prefill"]["transfers"] == 0 and llm.decode[0].metrics.transfers == 0


def test_the_bench_compares_colocated_and_xpyd_on_one_workload(servelab_tiny_checkpoint):
    from servelab.bench.disaggregated import format_comparison, parse_topology, run_comparison
    from servelab.bench.metrics import SLO
    from servelab.config import EngineConfig

    assert parse_topology("2p1d") == (2, 1)
    with pytest.raises(ConfigError, match="xPyD"):
        parse_topology("0P1D")
    result = run_comparison(EngineConfig.load(config(servelab_tiny_checkpoint)),
                            "fixed:num_requests=3,prompt_len=18,output_len=4", [(1, 1), (2, 1)],
                            SLO(ttft_ms=1e6, tpot_ms=1e6))
    assert [row["topology"] for row in result["rows"]] == ["colocated", "1P1D", "2P1D"]
    assert result["identical"] == {"1P1D": True, "2P1D": True}
    colocated_row, *split = result["rows"]
    assert colocated_row["kv_bytes_moved"] == 0 and all(row["kv_bytes_moved"] > 0 for row in split)
    assert all(row["slo_attainment"] == 1.0 and row["goodput_rps"] > 0 for row in result["rows"])
    assert all(row["ttft_ms"]["p50"] is not None and row["tpot_ms"]["p99"] is not None for row in result["rows"])
    assert "1P1D" in format_comparison(result)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_the_simulators_handoff_price_counts_the_bytes_a_real_handoff_moves(servelab_tiny_checkpoint,
                                                                             kv_cache_dtype):
    from servelab.bench.sim.handoff import HANDOFF_LINKS, handoff_bytes, handoff_link, handoff_rows

    cfg = config(servelab_tiny_checkpoint, kv_cache_dtype=kv_cache_dtype)
    with DisaggregatedLLM(config=cfg) as llm:
        llm.generate([PROMPTS[0]], [GREEDY[0]])
        moved = llm.metrics()["prefill"]["bytes"]
        model = llm.prefill[0].engine.model_config
    assert moved == handoff_bytes(model, len(PROMPTS[0]), 4, "float32", kv_cache_dtype) > 0
    assert handoff_bytes(model, 3, 4) == 0  # shorter than a block: nothing moves
    nvlink, ethernet = handoff_link("nvlink4"), handoff_link("ethernet-25g")
    assert nvlink.seconds(moved) < ethernet.seconds(moved) and nvlink.seconds(0) == 0.0
    rows = handoff_rows(model, 1024, 16, list(HANDOFF_LINKS))
    assert {r["kv_cache_dtype"] for r in rows} == {"auto", "fp8_e4m3"}
    assert all(r["bytes"] < s["bytes"] for r in rows if r["kv_cache_dtype"] == "fp8_e4m3"
               for s in rows if s["kv_cache_dtype"] == "auto")
    with pytest.raises(ConfigError, match="unknown handoff link"):
        handoff_link("carrier-pigeon")


def test_a_simulated_pd_fleet_serves_every_request_and_prices_its_handoffs():
    from servelab.bench.metrics import SLO
    from servelab.bench.sim.disaggregated import run_pd_comparison, run_pd_fleet
    from servelab.bench.sim.handoff import handoff_link
    from servelab.bench.sim.shapes import model_shape
    from servelab.config import EngineConfig
    from servelab.workload import build_workload

    model = model_shape("llama-3-8b")
    workload = build_workload("fixed:num_requests=12,prompt_len=200,output_len=8,arrival=poisson,rate=50",
                              model.vocab_size)
    config = EngineConfig.load({})
    slow = run_pd_fleet(config, workload, 1, 1, "h100", "llama-3-8b", handoff_link("ethernet-25g"))
    fast = run_pd_fleet(config, workload, 1, 1, "h100", "llama-3-8b", handoff_link("nvlink4"))
    for result in (slow, fast):
        assert [len(o.token_ids) for o in result["outputs"]] == [8] * 12
        assert all(o.finish_reason == "length" for o in result["outputs"]) and result["recomputes"] == 0
        # every prompt's full 16-token blocks, at Llama-3-8B's 128 KiB a token in bf16
        assert result["kv_bytes_moved"] == 12 * (200 // 16) * 16 * 128 * 1024
    # the same handoffs over a slower link: the second token waits for the bytes
    tpot = lambda result: sorted(o.tpot for o in result["outputs"])[6]  # noqa: E731
    assert tpot(slow) > tpot(fast)
    assert run_pd_fleet(config, workload, 1, 1, "h100", "llama-3-8b", handoff_link("nvlink4"))["outputs"][3] \
        .metrics == fast["outputs"][3].metrics  # simulated: the same figures every run
    comparison = run_pd_comparison(config, workload, [(1, 1)], "h100", "llama-3-8b", "nvlink4", SLO(1000, 100))
    assert [row["topology"] for row in comparison["rows"]] == ["colocated x2", "1P1D"]
    assert all(row["devices"] == 2 and row["goodput_per_device"] == row["goodput_rps"] / 2
               for row in comparison["rows"])


def test_the_planner_picks_the_split_with_most_goodput_per_device_meeting_the_slo():
    from servelab.bench.disaggregated import format_comparison
    from servelab.bench.metrics import SLO
    from servelab.bench.sim.disaggregated import plan_pd
    from servelab.bench.sim.shapes import model_shape
    from servelab.config import EngineConfig
    from servelab.workload import build_workload

    workload = build_workload("fixed:num_requests=16,prompt_len=300,output_len=6,arrival=poisson,rate=40",
                              model_shape("llama-3-8b").vocab_size)
    plan = plan_pd(EngineConfig.load({}), workload, "h100", "llama-3-8b", "nvlink4", SLO(1000, 100), 3, 0.9)
    # every split of 2 and 3 devices, with a tensor-parallel degree per role
    assert {row["topology"]: row["devices"] for row in plan["rows"]} == {
        "colocated x2": 2, "colocated x1 TP2": 2, "1P1D": 2,
        "colocated x3": 3, "1P2D": 3, "1P1D(TP2)": 3, "2P1D": 3, "1P(TP2)1D": 3}
    meeting = [row for row in plan["rows"] if row["slo_attainment"] >= 0.9]
    assert plan["best"] == max(meeting, key=lambda row: row["goodput_per_device"])["topology"]
    assert "goodput/device" in format_comparison(plan)
    impossible = plan_pd(EngineConfig.load({}), workload, "h100", "llama-3-8b", "nvlink4", SLO(0.001, 0.001), 2, 0.9)
    assert impossible["best"] is None


def test_the_roles_state_the_scheduler_side_of_the_contract(servelab_tiny_checkpoint):
    from servelab.interfaces import ConsumerScheduler, ProducerScheduler, TransferState

    class Holding(InProcessTransport):
        """Keeps offers unready until released."""

        ready = False

        def poll(self, transfer_id):
            status = super().poll(transfer_id)
            if not self.ready and status.state is TransferState.READY:
                return type(status)(TransferState.OFFERED, status.lease_deadline)
            return status

    transport = Holding()
    with DisaggregatedLLM(config=config(servelab_tiny_checkpoint), transport=transport) as llm:
        producer, consumer = llm.prefill[0], llm.decode[0]
        assert isinstance(producer, ProducerScheduler) and isinstance(consumer, ConsumerScheduler)
        transfer_id = llm.add_request(PROMPTS[0], GREEDY[0])
        while not producer.num_holds:
            llm.step()
        assert consumer.is_waiting(transfer_id)
        handoff = consumer._waiting[transfer_id].handoff
        assert consumer.remote_tokens(handoff) is None  # ask again later
        transport.ready = True
        assert consumer.remote_tokens(handoff) == (len(PROMPTS[0]) // 4) * 4  # nothing cached yet
        outputs = []
        while len(outputs) < 1:
            outputs += llm.step()
        assert consumer.remote_tokens(handoff) == 0  # now its own cache holds every block
        assert outputs[0].token_ids == colocated(config(servelab_tiny_checkpoint), GREEDY)[0]


def test_a_prefill_worker_shutting_down_ends_its_transfers_and_frees_its_blocks(servelab_tiny_checkpoint):
    """A server's prefill replica stopping with handoffs still held (a lease not yet over,
    a consumer yet to load) ends those transfers, so their consumers hear of it, frees their
    blocks and aborts the prefills in flight: nothing is held when it reports last."""
    from servelab.config import EngineConfig
    from servelab.disagg.producer import PrefillWorker
    from servelab.engine import LLMEngine
    from servelab.interfaces import TransferState

    engine = LLMEngine(EngineConfig.from_dict(config(servelab_tiny_checkpoint)))
    transport = InProcessTransport()
    worker = PrefillWorker(engine, transport, "prefill-0", lease_s=60.0)
    worker.add("held", PROMPTS[0], GREEDY[0])
    while not worker.num_holds:
        worker.step()
    worker.add("in-flight", PROMPTS[3], GREEDY[0])
    assert engine.allocator.stats().num_used_blocks > 0 and engine.has_unfinished()
    worker.shutdown()
    assert worker.num_holds == 0 and not engine.has_unfinished()
    assert engine.allocator.stats().num_used_blocks == 0
    assert transport.poll("held").state is TransferState.ABORTED


# ---------------------------------------------------------------- every request kind, as one engine serves it

TEXT_GREEDY = dict(max_tokens=12, temperature=0, ignore_eos=True)
TEXT_SEEDED = dict(max_tokens=12, temperature=0.9, top_p=0.95, ignore_eos=True)
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["n"]}


def _first_text(llm, tokens: list[int]) -> str:
    return llm.engine.tokenizer.decode(tokens[:1])


def _kinds(llm, plain) -> dict[str, tuple[list[SamplingParams], bool]]:
    """Per request kind: its params for each STORY prompt (some made from that prompt's
    greedy tokens `plain`), and whether its greedy output must differ from `plain` (the
    kind does something, on the decode engine's tokens at least)."""
    from servelab import StructuredOutput

    each = lambda params: [params] * len(STORY)  # noqa: E731
    return {
        "repetition_penalty": (each(SamplingParams(**TEXT_GREEDY, repetition_penalty=1.4)), True),
        "presence_and_frequency_penalties_seeded": ([SamplingParams(
            **TEXT_SEEDED, seed=s, presence_penalty=0.8, frequency_penalty=0.6) for s in range(4)], False),
        # the second token, the decode engine's first, banned
        "logit_bias": ([SamplingParams(**TEXT_GREEDY, logit_bias={o.token_ids[1]: -100}) for o in plain], True),
        # the first token is a stop token min_tokens holds back: on the prefill engine
        "min_tokens_on_the_prefill_engine": ([SamplingParams(**TEXT_GREEDY, min_tokens=2, stop_token_ids=[
            o.token_ids[0]]) for o in plain], True),
        # the third token is a stop token allowed once two are out: the first counts
        "min_tokens_count_the_first_token": ([SamplingParams(**TEXT_GREEDY, min_tokens=2, stop_token_ids=[
            o.token_ids[2]]) for o in plain], True),
        # a stop string in the first token's text, before min_tokens: neither engine stops there
        "a_stop_string_within_min_tokens": ([SamplingParams(**TEXT_GREEDY, min_tokens=3, stop=[
            _first_text(llm, o.token_ids)]) for o in plain], False),
        "bad_words": ([SamplingParams(**TEXT_GREEDY, bad_words=[o.text.split()[1]]) for o in plain], True),
        "structured_regex": (each(SamplingParams(max_tokens=12, temperature=0, structured=StructuredOutput.regex(
            r"(yes|no) \d{1,3}!"))), True),
        "structured_json_seeded": ([SamplingParams(max_tokens=24, temperature=0.8, seed=s,
                                                   structured=StructuredOutput.json(SCHEMA)) for s in range(4)], True),
        "logits_processor": (each(SamplingParams(**TEXT_GREEDY, logits_processors=["no-repeat-ngram"],
                                                 extra_args={"no_repeat_ngram_size": 2})), True),
        "prompt_logprobs": (each(SamplingParams(**TEXT_GREEDY, prompt_logprobs=3, logprobs=2)), False),
        "n_seeded": ([SamplingParams(**TEXT_SEEDED, n=3, seed=s) for s in range(4)], False),
        "n_with_penalties_and_prompt_logprobs": ([SamplingParams(**TEXT_SEEDED, n=2, seed=s, presence_penalty=1.0,
                                                                 prompt_logprobs=1, logprobs=1)
                                                  for s in range(4)], False),
    }


def _scores(positions) -> list:
    """Logprobs positions as comparable rows: (token, rank, text) and the value apart."""
    return [None if p is None else sorted((t, lp.rank, lp.decoded_token) for t, lp in p.items())
            for p in positions or []]


def _values_of(positions) -> list[float]:
    return [lp.logprob for p in positions or [] if p is not None for _, lp in sorted(p.items())]


def assert_as_one_engine(got, want) -> None:
    """Two requests' outputs equal: every completion's tokens, text, finish and stop reason;
    logprobs and prompt logprobs to 1e-4 (each engine's batch differs)."""
    assert len(got.outputs) == len(want.outputs)
    for mine, theirs in zip(got.outputs, want.outputs):
        assert (mine.index, mine.token_ids, mine.text, mine.finish_reason, mine.stop_reason) == \
            (theirs.index, theirs.token_ids, theirs.text, theirs.finish_reason, theirs.stop_reason)
        assert _scores(mine.logprobs) == _scores(theirs.logprobs)
        assert _values_of(mine.logprobs) == pytest.approx(_values_of(theirs.logprobs), abs=1e-4)
    assert got.prompt_token_ids == want.prompt_token_ids
    assert _scores(got.prompt_logprobs) == _scores(want.prompt_logprobs)
    assert _values_of(got.prompt_logprobs) == pytest.approx(_values_of(want.prompt_logprobs), abs=1e-4)


@pytest.fixture(scope="module")
def engine_pair():
    """One colocated engine and a 1P1D deployment of builtin:tiny (a tokenizer, for stop
    strings, bad words and grammars), and the colocated greedy answers to STORY."""
    cfg = config("builtin:tiny")
    llm, disaggregated = LLM(config=cfg), DisaggregatedLLM(config=cfg)
    plain = llm.generate(STORY, SamplingParams(**TEXT_GREEDY))
    yield llm, disaggregated, plain
    llm.close()
    disaggregated.close()


KINDS = ["repetition_penalty", "presence_and_frequency_penalties_seeded", "logit_bias",
         "min_tokens_on_the_prefill_engine", "min_tokens_count_the_first_token", "a_stop_string_within_min_tokens",
         "bad_words", "structured_regex", "structured_json_seeded", "logits_processor", "prompt_logprobs", "n_seeded",
         "n_with_penalties_and_prompt_logprobs"]


@pytest.mark.parametrize("kind", KINDS)
def test_every_request_kind_is_served_as_one_colocated_engine_serves_it(engine_pair, kind):
    """Penalties, logit bias, min_tokens, bad words, structured output and logits
    processors apply on both engines, the decode engine counting the prefill engine's first
    token as output (RequestSpec.continues); prompt logprobs come from the prefill engine;
    n > 1 is n handoffs, completion i seeded seed + i. Every answer is one colocated
    engine's, and no KV block is left held."""
    llm, disaggregated, plain = engine_pair
    params, changes = _kinds(llm, plain)[kind]
    expected = llm.generate(STORY, params)
    if changes:
        assert [o.token_ids for o in expected] != [o.token_ids for o in plain]
    transfers = disaggregated.metrics()["decode"]["transfers"]
    outputs = disaggregated.generate(STORY, params)
    for got, want in zip(outputs, expected):
        assert_as_one_engine(got, want)
    metrics = disaggregated.metrics()
    assert metrics["decode"]["transfers"] > transfers and metrics["decode"]["recomputes"] == 0
    disaggregated.step()  # the prefill engine frees the holds of transfers completed in the last step
    assert set(disaggregated.leaked_blocks().values()) == {0}


def test_an_engine_refuses_a_continuation_it_cannot_continue():
    """RequestSpec.continues names the prompt's last tokens, of one completion whose prompt
    another engine scored, with tokens left to generate; anything else is refused by name."""
    from servelab.request import RequestSpec

    llm = LLM(config=config("builtin:tiny"))
    try:
        engine = llm.engine
        prompt = engine.tokenizer.encode(STORY[0])
        for continues, params, message in (
                ((prompt[-1] + 1,), SamplingParams(), "the prompt's last tokens"),
                (tuple(prompt), SamplingParams(), "leave at least one prompt token"),
                ((prompt[-1],), SamplingParams(n=2), "n=2"),
                ((prompt[-1],), SamplingParams(prompt_logprobs=1), "prompt_logprobs"),
                ((prompt[-1],), SamplingParams(max_tokens=1), "max_tokens=1")):
            with pytest.raises(RequestError, match=message):
                engine.prepare_requests([RequestSpec(prompt, params, continues=continues)])
        assert not engine.has_unfinished()
    finally:
        llm.close()


def test_the_decode_router_finds_a_prompt_cached_under_its_adapter(tmp_path):
    """A decode engine reports the blocks it caches under an adapter by the names the
    router computes for a request with that adapter, so a second LoRA request of the same
    prompt goes where the first one's KV is cached, while that engine is the busier one."""
    pytest.importorskip("peft")
    from lora_adapters import build_adapter

    from servelab import LoRARequest
    from servelab.interfaces import RouteRequest, prefix_block_hashes
    from servelab.model.loader import resolve_model

    adapter = LoRARequest("tiny", 3, build_adapter(str(resolve_model("builtin:tiny")), tmp_path / "adapter", r=4,
                                                   seed=21, scale=0.3))
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    with DisaggregatedLLM(config=config("builtin:tiny", enable_lora=True), decode_engines=2,
                          failure_policy="fail") as disaggregated:
        [first] = disaggregated.generate(["Once upon a time there was a little cat"], greedy, lora_request=adapter)
        prompt = list(first.prompt_token_ids)
        summaries = [worker.engine.allocator.prefix_summary() for worker in disaggregated.decode]
        holder = next(i for i, summary in enumerate(summaries)
                      if set(prefix_block_hashes(prompt, 4, lora_id=3)) <= summary.block_hashes)
        assert all(summary.cached_tokens(prompt) == 0 for summary in summaries)  # never the base model's names
        disaggregated.decode[holder].engine.add_request(list(range(5, 25)), greedy)  # the holder gets busier
        engines = [worker.engine for worker in disaggregated.decode]
        route = RouteRequest("again", prompt + [first.outputs[0].token_ids[0]], 3, adapter="tiny", lora_id=3)
        assert disaggregated.router.choose_decode(route, engines) == holder
        assert disaggregated.router.choose_decode(RouteRequest("base", route.prompt_token_ids, 3), engines) != holder


def test_a_lora_adapter_applies_on_both_engines_and_its_kv_loads_for_it_alone(tmp_path):
    """A request with a LoRA adapter is prefilled and decoded with it (both engines load it
    by name), beside base-model requests: one colocated engine's tokens, which the adapter
    changes. Its KV is named by the adapter, so a consumer running the request without the
    adapter refuses the handoff."""
    pytest.importorskip("peft")
    from lora_adapters import build_adapter

    from servelab import LoRARequest
    from servelab.model.loader import resolve_model

    adapter = LoRARequest("tiny", 1, build_adapter(str(resolve_model("builtin:tiny")), tmp_path / "adapter", r=4,
                                                   seed=21, scale=0.3))
    cfg = config("builtin:tiny", enable_lora=True)
    adapters = [adapter, None, adapter, None]
    greedy = SamplingParams(**TEXT_GREEDY)
    llm = LLM(config=cfg)
    try:
        expected = llm.generate(STORY, greedy, lora_request=adapters)
        base = llm.generate(STORY, greedy)
    finally:
        llm.close()
    assert expected[0].token_ids != base[0].token_ids and expected[1].token_ids == base[1].token_ids
    with DisaggregatedLLM(config=cfg, failure_policy="fail") as disaggregated:
        outputs = disaggregated.generate(STORY, greedy, lora_request=adapters)
        assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
        assert disaggregated.metrics()["decode"]["transfers"] == len(STORY)
        producer, consumer = disaggregated.prefill[0], disaggregated.decode[0]
        producer.add("under-the-adapter", base[0].prompt_token_ids, greedy, lora_request=adapter)
        finished = []
        while not finished:
            finished = producer.step()
        [done] = finished
        assert done.handoff.num_blocks and producer.num_holds == 1
        failed = consumer.accept(done.handoff, greedy)  # the base model's request: not its KV
        assert failed.finish_reason == "error" and "another prompt" in failed.error
        disaggregated.step()
        assert set(disaggregated.leaked_blocks().values()) == {0}

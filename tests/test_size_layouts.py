"""`servelab size` over EP/PP layouts: each device's memory against the model's parameter
count, the constraints a layout must meet, the pipeline's bubble against its closed form,
the best layout of a table, and Mixtral-8x7B's and Llama-3-70B's layouts on 8 H100s."""

from __future__ import annotations

import json

import attrs
import pytest

from servelab import cli
from servelab.bench.sim.cost_model import CostModel
from servelab.bench.sim.hardware import accelerator, interconnect
from servelab.bench.sim.layout_table import LayoutSettings, compare_layouts, plan_layout
from servelab.bench.sim.layouts import (Layout, admissible_layouts, check_layout, engine_refusal, expert_placement,
                                        stage_layers)
from servelab.bench.sim.parallel_cost import (all_to_all_seconds, busiest_rank_experts,
                                              decode_attention_layer_seconds, roofline)
from servelab.bench.sim.shapes import model_shape
from servelab.bench.sim.sizing import memory_plan
from servelab.errors import ConfigError
from servelab.kv_sizing import kv_pool_blocks
from servelab.model.shard_layout import local_model_config

H100, NVLINK = accelerator("h100"), interconnect("nvlink4")
LLAMA_70B, MIXTRAL = model_shape("llama-3-70b"), model_shape("mixtral-8x7b")


def settings(**changes) -> LayoutSettings:
    base = LayoutSettings(block_size=16, context_len=4096, memory_utilization=0.9, kv_cache_dtype="auto",
                          max_num_seqs=256, max_num_batched_tokens=4096, micro_batches=0, expert_placement="linear",
                          redundant_experts=0, expert_load=None, chunk_sizing="fixed", max_chunk=None)
    return attrs.evolve(base, **changes)


def plan(shape, layout, hardware=H100, link=NVLINK, **changes):
    return plan_layout(shape, hardware, link, layout, settings(**changes))


def dense_parameters(shape) -> int:
    """Attention and the SwiGLU MLP of every layer, the embedding and the LM head (norms aside)."""
    h, q, kv = shape.hidden_size, shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    return shape.num_layers * (h * (q + 2 * kv) + q * h + 3 * h * shape.intermediate_size) + 2 * shape.vocab_size * h


def test_a_pure_pipeline_split_holds_the_model_once_over_its_stages():
    model_bytes = 2 * dense_parameters(LLAMA_70B)
    assert 70e9 < model_bytes / 2 < 71e9  # Llama-3-70B's 70.6 B parameters
    for stages in (2, 4, 8):
        memory = plan(LLAMA_70B, Layout(pp=stages))["memory"]
        assert sum(memory["stage_weight_bytes"]) == memory["total_weight_bytes"] == model_bytes
        # stage 0 holds its layers, the embedding and the LM head; the others their layers alone
        layer = (model_bytes - 2 * 2 * LLAMA_70B.vocab_size * LLAMA_70B.hidden_size) / 80
        assert memory["stage_weight_bytes"][1] == layer * len(stage_layers(80, 1, stages))
        assert memory["weight_bytes"] == memory["stage_weight_bytes"][0]


def test_weights_per_device_fall_as_stages_are_added():
    weights = [plan(LLAMA_70B, Layout(pp=stages))["memory"]["weight_bytes"] for stages in (1, 2, 4, 8, 16)]
    assert weights == sorted(weights, reverse=True) and len(set(weights)) == len(weights)


def test_a_tensor_parallel_layout_matches_the_cost_models_memory_plan():
    for tp in (2, 4, 8):
        memory = plan(LLAMA_70B, Layout(tp=tp))["memory"]
        reference = memory_plan(CostModel(LLAMA_70B, H100, tensor_parallel=tp), 16, 4096)
        assert memory["weight_bytes"] == reference.weight_bytes
        assert memory["kv_bytes_per_token"] == reference.kv_bytes_per_token
        assert memory["num_blocks"] == reference.num_blocks
        assert memory["max_concurrent_seqs"] == reference.max_concurrent_seqs


def test_the_engines_stage_split_is_the_one_sized():
    from servelab.distributed.pipeline_parallel import stage_layers as engine_stage_layers

    for layers, stages in ((80, 3), (32, 8), (7, 4), (5, 5)):
        assert [stage_layers(layers, s, stages) for s in range(stages)] == [
            engine_stage_layers(layers, s, stages) for s in range(stages)]


@pytest.mark.parametrize("shape, layout, message", [
    (LLAMA_70B, Layout(tp=3), "does not divide the model's num_attention_heads=64"),
    (LLAMA_70B, Layout(ep=2), "needs a mixture-of-experts model"),
    (LLAMA_70B, Layout(pp=81), "exceeds the model's 80 decoder layers"),
    (MIXTRAL, Layout(ep=16), "exceeds the model's 8 experts"),
    (LLAMA_70B, Layout(tp=0), "--tp must be a positive integer"),
])
def test_impossible_layouts_are_refused_naming_the_constraint(shape, layout, message):
    with pytest.raises(ConfigError, match=message):
        check_layout(shape, layout, H100)
    with pytest.raises(ConfigError, match=message):
        plan(shape, layout)


def test_layouts_on_a_fitted_cpu_profile_are_refused():
    with pytest.raises(ConfigError, match="GPU profile"):
        check_layout(model_shape("tiny-random"), Layout(pp=2), accelerator("cpu-here"))


def test_the_admissible_layouts_are_every_factorisation_the_model_allows():
    names = {layout.name for layout in admissible_layouts(LLAMA_70B, 8, H100)}
    assert names == {"TP8", "TP4xPP2", "TP2xPP4", "PP8"}  # no EP on a dense model
    # 8 = 2^3 over three factors: C(5, 2) = 10 ordered factorisations, all admitted by Mixtral, and EP x TP on the
    # same ranks over 8, 4 and 2 of them (PP 1, 2, 4)
    mixtral = admissible_layouts(MIXTRAL, 8, H100)
    assert len(mixtral) == 13 and all(layout.devices == 8 for layout in mixtral)
    assert [layout.name for layout in mixtral if layout.attention_tp] == [
        "EP8+TP-attn", "PP2xEP4+TP-attn", "PP4xEP2+TP-attn"]
    # 6 devices: TP 3 or 6 divides neither 64 heads; PP 6 and 3 are fine
    assert {layout.name for layout in admissible_layouts(LLAMA_70B, 6, H100)} == {"TP2xPP3", "PP6"}
    with pytest.raises(ConfigError, match="no layout of 9 devices"):
        admissible_layouts(model_shape("tiny-random"), 9, H100)  # 8 heads, 8 layers


def test_equal_chunks_leave_the_closed_form_bubble():
    """A stage's chunk time all fixed cost (free compute, memory and link): M chunks over S
    stages idle each (S - 1) / (M + S - 1) of the prefill."""
    hardware = attrs.evolve(H100, step_overhead_s=1.0, peak_flops=1e30, memory_bandwidth=1e30)
    link = attrs.evolve(NVLINK, latency_s=0.0, bus_bandwidth=1e30)
    for stages, chunk in ((2, 1024), (4, 1024), (4, 512), (8, 4096)):
        price = plan(LLAMA_70B, Layout(pp=stages), hardware, link, max_chunk=chunk)["price"]
        m = 4096 // chunk
        assert price["prefill_chunks"] == m
        assert price["bubble_fraction"] == pytest.approx((stages - 1) / (m + stages - 1), abs=1e-9)
        assert price["prefill_s"] == pytest.approx(m + stages - 1)


def test_a_decode_token_crosses_every_stage_and_stage_0_paces_a_full_pipeline():
    """Stage time all fixed cost (1 s): one sequence's token takes its trip through the S
    stages (S s); S micro-batches in flight take S s too, and yield S times the tokens."""
    hardware = attrs.evolve(H100, step_overhead_s=1.0, peak_flops=1e30, memory_bandwidth=1e30)
    link = attrs.evolve(NVLINK, latency_s=0.0, bus_bandwidth=1e30)
    one = plan(LLAMA_70B, Layout(pp=4), hardware, link, max_num_seqs=1)["price"]
    full = plan(LLAMA_70B, Layout(pp=4), hardware, link, max_num_seqs=8)["price"]
    assert one["decode_step_s"] == pytest.approx(4.0) and full["decode_step_s"] == pytest.approx(4.0)
    assert full["decode_tokens_per_s"] == pytest.approx(8 * one["decode_tokens_per_s"])


def test_the_default_chunks_cut_a_step_into_one_micro_batch_per_stage():
    for stages in (1, 2, 4):
        assert plan(LLAMA_70B, Layout(tp=8 // stages, pp=stages))["price"]["prefill_chunks"] == stages
    assert plan(LLAMA_70B, Layout(tp=2, pp=4), micro_batches=8)["price"]["prefill_chunks"] == 8


def test_the_best_layout_has_the_most_throughput_among_those_that_fit():
    # Llama-3-70B on 8 L4s at 8k context, 40 % of the free memory for KV: PP8 holds no sequence, TP8 does
    result = compare_layouts(LLAMA_70B, accelerator("l4"), interconnect("pcie4"), 8,
                             settings(context_len=8192, memory_utilization=0.4, max_num_batched_tokens=8192))
    fitting = [row for row in result["rows"] if row["fits"]]
    assert fitting and len(fitting) < len(result["rows"])
    assert all((row["price"] is None) == (not row["fits"]) for row in result["rows"])
    assert result["best"] == max(fitting, key=lambda row: row["price"]["decode_tokens_per_s"])["layout"]


def test_mixtral_on_8_h100s_tp8_against_ep8():
    h, layers, width, vocab = 4096, 32, 14336, 32000
    attention = h * (32 * 128 + 2 * 8 * 128) + 32 * 128 * h
    expert = 3 * h * width
    tp8, ep8 = plan(MIXTRAL, Layout(tp=8)), plan(MIXTRAL, Layout(ep=8))
    # TP8 splits everything but the router 8 ways; EP8 holds attention, router, embedding and head whole, one expert
    assert tp8["memory"]["weight_bytes"] == 2 * (layers * (attention / 8 + 8 * h + 8 * expert / 8) + 2 * vocab * h / 8)
    assert ep8["memory"]["weight_bytes"] == 2 * (layers * (attention + 8 * h + expert) + 2 * vocab * h)
    assert 46e9 < tp8["memory"]["total_weight_bytes"] / 2 < 47.5e9  # Mixtral's 46.7 B, the router 8 times
    # TP8 holds one KV head of 8 a device, EP8 all 8 for its own sequences: 8 x the bytes a token, 8 ranks of sequences
    assert ep8["memory"]["kv_bytes_per_token"] == 8 * tp8["memory"]["kv_bytes_per_token"] == layers * 8 * 128 * 2 * 2
    assert ep8["memory"]["max_concurrent_seqs"] == 8 * (ep8["memory"]["num_blocks"] // 256)
    # EP8's dispatch and combine: 256 sequences over 8 ranks, top-2 rows of 4096 bf16 each way, 7/8 leaving, every layer
    assert ep8["price"]["all_to_all_bytes"] == layers * 2 * (256 / 8) * 2 * h * 2 * 7 / 8
    assert tp8["price"]["all_to_all_bytes"] == 0 and tp8["price"]["decode_batch"] == 256
    # the whole table: TP8 streams the fewest bytes a device and wins decode within one NVLink node
    result = compare_layouts(MIXTRAL, H100, NVLINK, 8, settings())
    rows = {row["layout"]: row for row in result["rows"]}
    assert len(rows) == 13 and all(row["fits"] for row in rows.values())
    assert result["best"] == "TP8"
    assert rows["PP8"]["price"]["bubble_fraction"] > rows["TP4xPP2"]["price"]["bubble_fraction"] > 0
    assert rows["EP8"]["servelab_runs"] and not rows["TP8"]["servelab_runs"]
    assert "does not shard a mixture-of-experts" in engine_refusal(MIXTRAL, Layout(tp=8))


def test_placement_and_expert_load_price_ep_imbalance():
    """Two hot neighbouring experts: linear puts them on one rank, round_robin splits them.
    A prefill's experts are compute-bound, so the busiest rank's rows set its time; a decode
    step's read their weights, as many on every rank, whatever the rows."""
    load = (30.0, 25.0, 10.0, 9.0, 8.0, 7.0, 6.0, 5.0)
    prices = {name: plan(MIXTRAL, Layout(ep=4), expert_placement=name, expert_load=load)["price"]
              for name in ("linear", "round_robin")}
    assert prices["linear"]["expert_imbalance"] == pytest.approx((30 + 25) / (sum(load) / 4))
    assert prices["round_robin"]["expert_imbalance"] < prices["linear"]["expert_imbalance"]
    assert prices["round_robin"]["prefill_s"] < prices["linear"]["prefill_s"]
    assert prices["round_robin"]["decode_tokens_per_s"] >= prices["linear"]["decode_tokens_per_s"]
    balanced = plan(MIXTRAL, Layout(ep=4), expert_placement="balanced", expert_load=load, redundant_experts=4)
    assert balanced["memory"]["weight_bytes"] > plan(MIXTRAL, Layout(ep=4))["memory"]["weight_bytes"]  # replicas
    with pytest.raises(ConfigError, match="needs 8 non-negative weights"):
        plan(MIXTRAL, Layout(ep=4), expert_load=(1.0, 2.0))


def test_the_step_cost_model_refuses_a_mixture_of_experts():
    with pytest.raises(ConfigError, match="mixture of experts"):
        CostModel(MIXTRAL, H100, tensor_parallel=8)


def test_size_command_layouts_and_single_layouts(tmp_path, capsys):
    base = ["size", "--sim", "h100", "--context-len", "4096"]
    out = tmp_path / "layouts.json"
    assert cli.main([*base, "--sim-model", "mixtral-8x7b", "--layouts", "8", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    layouts = json.loads(out.read_text())["layouts"]
    assert layouts["best"] == "TP8" and len(layouts["rows"]) == 13
    assert f"best ({layouts['criterion']}): TP8" in printed and "EP8" in printed
    out = tmp_path / "pp.json"
    assert cli.main([*base, "--sim-model", "llama-3-70b", "--pp", "4", "--json", str(out)]) == 0
    single = json.loads(out.read_text())
    assert (single["pipeline_parallel"], single["tensor_parallel"], single["layout"]["layout"]) == (4, 1, "PP4")
    assert "rate" not in single and single["layout"]["price"]["prefill_chunks"] == 4
    # --pp N is engine.pipeline_parallel_size
    out_set = tmp_path / "pp_set.json"
    assert cli.main([*base, "--sim-model", "llama-3-70b", "--set", "engine.pipeline_parallel_size=4",
                     "--json", str(out_set)]) == 0
    assert json.loads(out_set.read_text())["layout"] == single["layout"]
    capsys.readouterr()
    assert cli.main([*base, "--sim-model", "llama-3-70b", "--ep", "2"]) == 2
    assert "needs a mixture-of-experts model" in capsys.readouterr().err
    assert cli.main([*base, "--sim-model", "llama-3-70b", "--layouts", "8", "--tp", "2"]) == 2
    assert "drop --tp" in capsys.readouterr().err


# EP x TP on the same ranks (servelab.distributed.expert_tensor_parallel, vLLM's --enable-expert-parallel)
EP8_TP = Layout(tp=8, ep=8, attention_tp=True)


def test_ep_with_attention_tp_on_the_same_ranks_splits_attention_and_holds_the_rest_whole():
    h, layers, width, vocab = 4096, 32, 14336, 32000
    attention = h * (32 * 128 + 2 * 8 * 128) + 32 * 128 * h
    expert = 3 * h * width
    same, ep8, tp8 = plan(MIXTRAL, EP8_TP), plan(MIXTRAL, Layout(ep=8)), plan(MIXTRAL, Layout(tp=8))
    assert EP8_TP.devices == 8 and same["devices"] == 8 and same["attention_tp"]
    # a device: attention / 8, its one expert at full width, the router, embedding and LM head whole
    assert same["memory"]["weight_bytes"] == 2 * (layers * (attention / 8 + 8 * h + expert) + 2 * vocab * h)
    assert ep8["memory"]["weight_bytes"] - same["memory"]["weight_bytes"] == 2 * layers * attention * 7 / 8
    # over the 8 devices: attention once, every expert once, router, embedding and LM head 8 times
    assert same["memory"]["total_weight_bytes"] == 2 * (layers * (attention + 8 * 8 * h + 8 * expert)
                                                        + 8 * 2 * vocab * h)
    # KV: one KV head of 8 a device, as TP8's; with TP8's memory left, TP8's KV tokens
    assert same["memory"]["kv_bytes_per_token"] == tp8["memory"]["kv_bytes_per_token"] == layers * 128 * 2 * 2
    heavier = same["memory"]["weight_bytes"] - tp8["memory"]["weight_bytes"]
    roomier = attrs.evolve(H100, memory_bytes=H100.memory_bytes - heavier)
    assert (plan(MIXTRAL, Layout(tp=8), hardware=roomier)["memory"]["kv_tokens_per_device"]
            == same["memory"]["kv_tokens_per_device"])
    assert same["memory"]["num_blocks"] == kv_pool_blocks(
        0.9 * (H100.memory_bytes - H100.reserved_bytes - same["memory"]["weight_bytes"]), layers * 128 * 2 * 2, 16)
    # every rank attends to all the sequences: the layout holds one rank's, not 8 ranks' as EP8's data-parallel attention
    assert same["memory"]["max_concurrent_seqs"] == same["memory"]["num_blocks"] // 256
    assert ep8["memory"]["max_concurrent_seqs"] == 8 * (ep8["memory"]["num_blocks"] // 256)


def test_ep_with_attention_tp_prices_tp_attention_one_all_reduce_and_eps_experts_over_the_whole_batch():
    h, layers, vocab, batch, context = 4096, 32, 32000, 256, 4096
    price = plan(MIXTRAL, EP8_TP)["price"]
    link = NVLINK
    # attention as TP8's (4 heads and 1 KV head a device) over all 256 sequences, then o_proj's all-reduce of them
    heads = local_model_config(MIXTRAL, 8)
    attention = decode_attention_layer_seconds(heads, H100, batch, context, 128 * 2 * 2, 2)
    all_reduce = link.latency_s + 2 * 7 / 8 * batch * h * 2 / link.bus_bandwidth
    # the busiest rank's experts over the whole batch's rows at full width; each rank dispatches 1/8 of the rows
    placement = expert_placement(MIXTRAL, 8, "linear", 0, None)
    experts, imbalance = busiest_rank_experts(MIXTRAL, H100, batch, placement, [1.0] * 8)
    moved = batch / 8 * 2 * h * 2
    exchange = 2 * all_to_all_seconds(link, moved, 8)
    lm_head = roofline(H100, 2 * batch * vocab * h, vocab * h * 2)  # whole on every rank
    step = layers * (attention + all_reduce + experts + exchange) + H100.step_overhead_s + lm_head
    assert price["decode_batch"] == batch and imbalance == price["expert_imbalance"] == 1.0
    assert price["decode_step_s"] == pytest.approx(step, rel=1e-12)
    assert price["all_to_all_bytes"] == layers * 2 * moved * 7 / 8 == plan(MIXTRAL, Layout(ep=8))["price"][
        "all_to_all_bytes"]
    # the prompt's attention is split by heads over all 8 ranks, not run on the one EP rank holding its sequence
    assert price["prefill_s"] < plan(MIXTRAL, Layout(ep=8))["price"]["prefill_s"]


def test_ep_with_attention_tp_is_enumerated_for_a_mixture_of_experts_where_the_heads_admit_it():
    names = [layout.name for layout in admissible_layouts(MIXTRAL, 8, H100)]
    assert names.index("EP8+TP-attn") == names.index("EP8") + 1  # beside its stage count's layouts
    assert not any("TP-attn" in layout.name for layout in admissible_layouts(LLAMA_70B, 8, H100))  # dense
    # 6 devices: TP 6 and 3 divide none of Mixtral's 32 heads, so EP6 and PP2xEP3 have no +TP-attn; PP3xEP2 has
    six = {layout.name for layout in admissible_layouts(MIXTRAL, 6, H100)}
    assert {"EP6", "PP2xEP3", "PP3xEP2+TP-attn"} <= six and not {"EP6+TP-attn", "PP2xEP3+TP-attn"} & six
    # 16 devices: EP16 exceeds the 8 experts; PP2 x EP8+TP-attn fits
    sixteen = {layout.name for layout in admissible_layouts(MIXTRAL, 16, H100)}
    assert "PP2xEP8+TP-attn" in sixteen and "EP16+TP-attn" not in sixteen


@pytest.mark.parametrize("layout, message", [
    (Layout(tp=4, ep=2, attention_tp=True), "needs --tp equal to --ep, both above 1"),
    (Layout(tp=1, ep=1, attention_tp=True), "needs --tp equal to --ep, both above 1"),
    (Layout(tp=6, ep=6, attention_tp=True), "does not divide the model's num_attention_heads=32"),
])
def test_ep_with_attention_tp_refuses_what_the_engine_cannot_split(layout, message):
    with pytest.raises(ConfigError, match=message):
        check_layout(MIXTRAL, layout, H100)


def test_servelab_runs_ep_with_attention_tp_without_pp():
    assert engine_refusal(MIXTRAL, EP8_TP) is None
    assert engine_refusal(MIXTRAL, Layout(tp=2, ep=2, attention_tp=True)) is None
    assert "pipeline_parallel_size > 1 do not combine yet" in engine_refusal(
        MIXTRAL, Layout(tp=4, pp=2, ep=4, attention_tp=True))
    assert "not EP ranks that are TP groups" in engine_refusal(MIXTRAL, Layout(tp=2, ep=2))  # the grid
    assert "not EP ranks that are TP groups" in engine_refusal(MIXTRAL, Layout(tp=2, ep=4))
    result = compare_layouts(MIXTRAL, H100, NVLINK, 8, settings())
    rows = {row["layout"]: row for row in result["rows"]}
    assert rows["EP8+TP-attn"]["servelab_runs"] and not rows["PP2xEP4+TP-attn"]["servelab_runs"]


def test_size_command_tp_and_ep_together_are_the_same_ranks(tmp_path, capsys):
    base = ["size", "--sim", "h100", "--context-len", "4096", "--sim-model", "mixtral-8x7b"]
    table, single = tmp_path / "layouts.json", tmp_path / "single.json"
    assert cli.main([*base, "--layouts", "8", "--json", str(table)]) == 0
    assert cli.main([*base, "--tp", "8", "--ep", "8", "--json", str(single)]) == 0
    printed = capsys.readouterr().out
    rows = {row["layout"]: row for row in json.loads(table.read_text())["layouts"]["rows"]}
    planned = json.loads(single.read_text())
    assert planned["layout"] == rows["EP8+TP-attn"]
    assert (planned["tensor_parallel"], planned["expert_parallel"], planned["layout"]["devices"]) == (8, 8, 8)
    assert "EP8+TP-attn" in printed and "servelab's engine runs it (EP x TP" in printed
    assert "attention replicated" not in printed.split("as EP8+TP-attn")[1]
    # unequal: refused naming both options
    assert cli.main([*base, "--tp", "4", "--ep", "2"]) == 2
    err = capsys.readouterr().err
    assert "--tp 4 with --ep 2" in err and "--tp must equal --ep" in err and "--layouts 8" in err
    assert cli.main(["size", "--sim", "h100", "--sim-model", "llama-3-70b", "--tp", "8", "--ep", "8"]) == 2
    assert "needs a mixture-of-experts model" in capsys.readouterr().err

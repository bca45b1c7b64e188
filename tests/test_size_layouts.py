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
from servelab.bench.sim.layouts import Layout, admissible_layouts, check_layout, engine_refusal, stage_layers
from servelab.bench.sim.shapes import model_shape
from servelab.bench.sim.sizing import memory_plan
from servelab.errors import ConfigError

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
    # 8 = 2^3 over three factors: C(5, 2) = 10 ordered factorisations, all admitted by Mixtral
    mixtral = admissible_layouts(MIXTRAL, 8, H100)
    assert len(mixtral) == 10 and all(layout.devices == 8 for layout in mixtral)
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
    assert len(rows) == 10 and all(row["fits"] for row in rows.values())
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
    assert layouts["best"] == "TP8" and len(layouts["rows"]) == 10
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

"""Mixture-of-experts models (Mixtral, Qwen2-MoE with its shared expert, Qwen3-MoE with
its query/key norms) decode as `transformers` does: token for token in float32, and on
int8/int4 blocks as `transformers` does on their dequantization; bfloat16 within its
rounding. The grouped expert path equals the per-expert loop. Shapes are odd on purpose
(5, 3, 7 and 6 experts; top-k 1, 2 and 3; hidden 36, 40, 52; a dense layer among sparse ones)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from servelab import LLM, SamplingParams
from servelab.model.loader import Checkpoint, load_model
from servelab.model.moe import Projection, SparseMoeBlock, grouped_experts, loop_experts
from servelab.model.moe_model import MoEForCausalLM
from servelab.model.quantized_linear import SCHEMES, QuantizedLinear, QuantizedWeight

MOE_KINDS = ["mixtral", "mixtral-top1", "qwen2_moe", "qwen3_moe"]
PROMPTS = [[5, 9, 13, 2, 40, 7], list(range(3, 40)), [17], [8, 8, 8, 90, 91]]
MAX_NEW = [12, 9, 15, 7]


def hf_greedy(path: str, prompts=PROMPTS, max_new=MAX_NEW, dtype=torch.float32) -> list[list[int]]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return [model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(p):].tolist() for p, n in zip(prompts, max_new)]


def servelab_greedy(path: str, prompts=PROMPTS, max_new=MAX_NEW, **engine) -> list[list[int]]:
    llm = LLM(path, max_model_len=128, **engine)
    outputs = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in max_new])
    assert llm.engine.allocator.stats().num_used_blocks == 0
    return [o.token_ids for o in outputs]


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_float32_greedy_matches_transformers(checkpoint_factory, kind):
    path = checkpoint_factory(kind)
    expected = hf_greedy(path)
    assert len({t for run in expected for t in run}) > 5, "the tiny model's output should vary"
    assert servelab_greedy(path) == expected


def test_the_model_is_built_sparse_where_the_config_says(checkpoint_factory):
    """Qwen2-MoE's `mlp_only_layers=[1]` keeps layer 1 dense; the others are sparse, with the
    shared expert; the checkpoint's config numbers reach the blocks."""
    checkpoint = Checkpoint.open(checkpoint_factory("qwen2_moe"))
    model = load_model(checkpoint, "float32", "cpu", 64)
    assert isinstance(model, MoEForCausalLM)
    assert sorted(model.sparse_blocks()) == [0, 2]
    block = model.sparse_blocks()[0]
    assert len(block.experts) == 7 and block.shape.top_k == 3 and not block.shape.norm_topk_prob
    assert block.shared_expert is not None and block.experts[0].down_proj.in_features == 24


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_moe_models_take_the_python_path_not_the_native_decoder(checkpoint_factory, kind):
    """The native decoder knows only the dense MLP: it is never asked to run a MoE model,
    even with the cpu-paged kernels built, and the output is still transformers'."""
    path = checkpoint_factory(kind)
    llm = LLM(path, max_model_len=128, **{"attention.name": "cpu-paged", "attention.build": "wait"})
    backend = llm.engine.runner.backend
    asked = []
    if hasattr(type(backend), "decoder_forward"):
        forward = backend.decoder_forward
        backend.decoder_forward = lambda *args: asked.append(1) or forward(*args)
    outputs = llm.generate(PROMPTS, [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in MAX_NEW])
    assert [o.token_ids for o in outputs] == hf_greedy(path)
    assert not asked


def _dequantized_moe_checkpoint(source: str, target, weights: str) -> str:
    """`source` with every weight servelab quantizes under `weights` replaced by the values
    of its blocks (the stacked experts one expert at a time; the routers stay float)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    decoder_format, head_format = SCHEMES[weights]

    def roundtrip(weight: torch.Tensor, format: str) -> torch.Tensor:
        return QuantizedWeight.quantize(weight, format).dequantize()

    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear) and not name.endswith("shared_expert_gate"):
                module.weight.copy_(roundtrip(module.weight, head_format if name == "lm_head" else decoder_format))
        for name, param in model.named_parameters():
            if param.dim() == 3:  # stacked experts
                for expert in range(param.shape[0]):
                    param[expert].copy_(roundtrip(param[expert], decoder_format))
    model.save_pretrained(target)
    return str(target)


@pytest.mark.parametrize("kind, weights", [("mixtral", "int8"), ("qwen2_moe", "int4"), ("qwen3_moe", "int8"),
                                           ("mixtral-top1", "int4")])
def test_quantized_experts_match_transformers_on_the_dequantized_weights(checkpoint_factory, tmp_path, kind, weights):
    path = checkpoint_factory(kind)
    expected = hf_greedy(_dequantized_moe_checkpoint(path, tmp_path / "dequantized", weights))
    # float activations: the quantized blocks' exact product, comparable token for token with
    # transformers on the dequantized weights (int8 activations are checked in test_quantized_weights)
    llm = LLM(path, max_model_len=128, weights=weights, quantized_activations="float",
              **{"attention.name": "cpu-paged", "attention.build": "wait"})
    outputs = llm.generate(PROMPTS, [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in MAX_NEW])
    assert [o.token_ids for o in outputs] == expected
    model = llm.engine.runner.model
    block = next(iter(model.sparse_blocks().values()))
    assert all(isinstance(expert.gate_up_proj, QuantizedLinear) for expert in block.experts)
    assert isinstance(block.gate, Projection)  # the router keeps its float weight


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_bfloat16_prompt_logprobs_agree_with_transformers_within_rounding(checkpoint_factory, kind):
    """In bfloat16 the expert sums round differently, so the check is the scores of every
    prompt token against transformers' float32 ones, within bfloat16's rounding."""
    import transformers

    path = checkpoint_factory(kind)
    prompt = list(range(3, 40))
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        reference = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    expected = [reference[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
    llm = LLM(path, max_model_len=128, dtype="bfloat16")
    output = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))[0]
    got = [position[token].logprob for position, token in zip(output.prompt_logprobs[1:], prompt[1:])]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), atol=0.15, rtol=0.05)


def _block(checkpoint_factory, kind: str) -> SparseMoeBlock:
    checkpoint = Checkpoint.open(checkpoint_factory(kind))
    return next(iter(load_model(checkpoint, "float32", "cpu", 64).sparse_blocks().values()))


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe"])
@pytest.mark.parametrize("tokens", [1, 3, 64])
def test_grouped_experts_equal_the_per_expert_loop(checkpoint_factory, kind, tokens):
    """The grouped path (sort by expert, one matmul pair per expert, unpermute, weighted
    reduce) against the plain per-expert loop, on routings where some experts get no token."""
    block = _block(checkpoint_factory, kind)
    generator = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, block.gate.weight.shape[1], generator=generator)
    with torch.inference_mode():
        weights, ids = block.route(x)
        grouped = grouped_experts(x, weights, ids, block.experts)
        looped = loop_experts(x, weights, ids, block.experts)
        naive = torch.stack([sum(weights[t, k] * block.experts[int(ids[t, k])](x[t:t + 1])[0]
                                 for k in range(ids.shape[1])) for t in range(tokens)])
    torch.testing.assert_close(grouped, looped, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grouped, naive, rtol=1e-5, atol=1e-5)


def test_pairs_split_between_ranks_sum_to_the_whole_to_the_bit(checkpoint_factory):
    """`mine` leaves the other pairs' rows zero: the rows of two complementary halves (what
    expert parallelism's ranks each compute) add up to the whole. With each expert wholly
    on one rank the sum is the grouped path's output to the bit (the same matmuls over the
    same rows); with an expert's pairs split between replicas, to float rounding (a matmul
    over fewer rows may round its sums otherwise)."""
    from servelab.model.moe import combine_rows, expert_rows

    block = _block(checkpoint_factory, "qwen2_moe")
    x = torch.randn(20, block.gate.weight.shape[1], generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        weights, ids = block.route(x)
        whole = grouped_experts(x, weights, ids, block.experts)
        by_expert = ids % 2 == 0
        first, token_of = expert_rows(x, weights, ids, block.experts, by_expert)
        second, _ = expert_rows(x, weights, ids, block.experts, ~by_expert)
        assert torch.equal(combine_rows(x, first + second, token_of), whole)
        by_pair = (torch.arange(20).unsqueeze(1) + ids) % 2 == 0
        first, token_of = expert_rows(x, weights, ids, block.experts, by_pair)
        second, _ = expert_rows(x, weights, ids, block.experts, ~by_pair)
        torch.testing.assert_close(combine_rows(x, first + second, token_of), whole, rtol=1e-5, atol=1e-6)


def test_expert_load_counts_every_routed_assignment(checkpoint_factory):
    path = checkpoint_factory("mixtral")
    llm = LLM(path, max_model_len=128)
    llm.generate(PROMPTS, [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in MAX_NEW])
    first, last = llm.engine.runner.model.sparse_blocks().values()
    # the first layer routes every token computed (prompt and decode rows) to top_k=2 experts;
    # the last computes past attention only the rows whose logits are wanted (a prompt's last)
    computed = sum(len(p) for p in PROMPTS) + sum(n - 1 for n in MAX_NEW)
    assert int(first.expert_load.sum()) == 2 * computed and len(first.expert_load) == 5
    assert int(last.expert_load.sum()) == 2 * (len(PROMPTS) + sum(n - 1 for n in MAX_NEW))


def test_an_unknown_moe_config_is_a_clear_error(tmp_path, checkpoint_factory):
    from servelab.errors import CheckpointError

    raw = json.load(open(f"{checkpoint_factory('mixtral')}/config.json"))
    raw["num_experts_per_tok"] = 9
    from servelab.model.model_config import ModelConfig

    with pytest.raises(CheckpointError, match="num_experts_per_tok=9 must lie in 1..5"):
        ModelConfig.from_dict(raw)


def test_a_config_naming_expert_groups_routes_with_grouped_top_k(checkpoint_factory, tmp_path):
    """`n_group` / `topk_group` (DeepSeek's keys) select grouped top-k: every token's experts
    then come from at most `topk_group` of the groups."""
    import shutil

    from servelab.model.expert_routing import GroupedTopK

    path = tmp_path / "grouped"
    shutil.copytree(checkpoint_factory("qwen3_moe"), path)
    raw = json.loads((path / "config.json").read_text())
    raw.update(n_group=3, topk_group=1)  # 6 experts in 3 groups of 2; top-3 would need 2 groups: top_k 2
    raw["num_experts_per_tok"] = 2
    (path / "config.json").write_text(json.dumps(raw))
    llm = LLM(str(path), max_model_len=64)
    block = next(iter(llm.engine.runner.model.sparse_blocks().values()))
    assert isinstance(block.routing, GroupedTopK) and block.routing.num_groups == 3
    x = torch.randn(40, 52, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        _, ids = block.route(x)
    assert all(len({int(e) // 2 for e in row}) == 1 for row in ids)  # one group per token
    assert len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0].token_ids) == 4

"""Speculative decoding end to end: greedy output with every drafter is token-identical to
Hugging Face `transformers` greedy generation (so to decoding without speculation),
under continuous and chunked-prefill scheduling, with every allocator, and with a pool
small enough to preempt; seeded sampling keeps the target's distribution."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from servelab import LLM, ConfigError, PluginError, SamplingParams
from servelab.testing import DrafterContract

from test_hf_equivalence import hf_greedy

VOCAB = 211
MAX_NEW = [24, 16, 30, 20, 12, 28]


def spec_prompts() -> list[list[int]]:
    """Prompts that repeat themselves (lookup drafters hit) and prompts that do not."""
    rng = random.Random(11)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, VOCAB) for _ in range(n)]

    passage = tokens(20)
    return [passage + passage[:7], tokens(9), passage * 2 + passage[:3], tokens(1), tokens(30) + passage[:5],
            passage[:10] * 3]


@pytest.fixture(scope="module")
def reference(checkpoint_factory):
    path = checkpoint_factory("llama")
    return path, [hf_greedy(path, p, n) for p, n in zip(spec_prompts(), MAX_NEW)]


def medusa_heads(directory, hidden_size: int, num_heads: int = 3) -> str:
    """Random (untrained) Medusa heads: drafts mostly wrong, which verification must absorb."""
    import json

    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for i in range(num_heads):
        tensors[f"medusa_heads.{i}.weight"] = torch.randn(hidden_size, hidden_size, generator=generator) * 0.1
        tensors[f"medusa_heads.{i}.bias"] = torch.zeros(hidden_size)
    save_file(tensors, str(directory / "medusa.safetensors"))
    (directory / "medusa_config.json").write_text(json.dumps({"num_heads": num_heads, "hidden_size": hidden_size}))
    return str(directory)


def eagle_head(directory, checkpoint: str, feature_layers=(0,)) -> str:
    """A random (untrained) EAGLE head for `checkpoint`: drafts mostly wrong."""
    from servelab.plugins.drafters.eagle_head import EagleHead, HeadConfig, save_head

    config = json.loads((Path(checkpoint) / "config.json").read_text())
    torch.manual_seed(0)
    heads = config["num_attention_heads"]
    head = EagleHead(HeadConfig(hidden_size=config["hidden_size"], num_heads=heads,
                                num_kv_heads=config["num_key_value_heads"],
                                head_dim=config.get("head_dim") or config["hidden_size"] // heads,
                                intermediate_size=config["intermediate_size"], feature_layers=feature_layers))
    save_head(head, Path(directory), torch.float32)
    return str(directory)


def drafter_config(name: str, checkpoint_factory, tmp_path_factory) -> dict:
    if name == "ngram":
        return {"name": "ngram", "num_speculative_tokens": 4, "max_ngram": 3}
    if name == "draft-model":
        return {"name": "draft-model", "model": checkpoint_factory("llama-draft"), "num_speculative_tokens": 3}
    if name == "draft-model-self":  # the target drafting for itself: every greedy draft is accepted
        return {"name": "draft-model", "model": checkpoint_factory("llama"), "num_speculative_tokens": 5}
    if name == "medusa":
        return {"name": "medusa", "heads": medusa_heads(tmp_path_factory.mktemp("medusa"), 72)}
    if name == "medusa-tree":  # a static tree from made-up accuracies (rank r of head h: 0.5 / (h + r + 1))
        heads = Path(medusa_heads(tmp_path_factory.mktemp("medusa"), 72))
        (heads / "medusa_accuracy.json").write_text(json.dumps(
            {"top_k_accuracy": [[0.5 / (h + r + 1) for r in range(4)] for h in range(3)]}))
        return {"name": "medusa", "heads": str(heads), "tree_nodes": 6, "tree_top_k": 4}
    if name == "eagle":
        return {"name": "eagle", "num_speculative_tokens": 3,
                "heads": eagle_head(tmp_path_factory.mktemp("eagle"), checkpoint_factory("llama"))}
    if name == "eagle-tree":
        return {"name": "eagle", "num_speculative_tokens": 3, "tree_nodes": 6, "tree_top_k": 3,
                "heads": eagle_head(tmp_path_factory.mktemp("eagle"), checkpoint_factory("llama"))}
    if name == "suffix-tree":
        return {"name": "suffix", "num_speculative_tokens": 4, "max_depth": 7, "cache_tokens": 40, "tree_nodes": 6}
    if name == "suffix":  # a shallow trie, so matches are cut at max_depth - k and the global cache evicts
        return {"name": "suffix", "num_speculative_tokens": 4, "max_depth": 7, "cache_tokens": 40}
    if name.endswith("-dynamic"):
        return {**drafter_config(name[: -len("-dynamic")], checkpoint_factory, tmp_path_factory),
                "dynamic_length": True}
    raise AssertionError(name)


def run(path: str, drafter: dict | None, **engine) -> tuple[list[list[int]], LLM]:
    config = {"drafter": drafter} if drafter else {}
    llm = LLM(path, config=config, **{"max_model_len": 128, "block_size": 8, **engine})
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in MAX_NEW]
    outputs = llm.generate(spec_prompts(), params)
    assert llm.engine.allocator.stats().num_used_blocks == 0, "blocks leaked after every request finished"
    return [o.token_ids for o in outputs], llm


DRAFTERS = ["ngram", "suffix", "suffix-tree", "suffix-dynamic", "draft-model", "draft-model-self", "medusa",
            "medusa-tree", "eagle", "eagle-tree"]
SETTINGS = {
    "continuous": {},
    # A 6-token budget cuts drafts short and chunks prompts around them.
    "chunked-prefill": {"scheduler.name": "chunked-prefill", "max_num_batched_tokens": 6},
    # 12 blocks of 8 slots: sequences are preempted and recomputed mid-speculation.
    "tight-pool": {"num_kv_blocks": 12, "max_model_len": 96},
}


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("drafter", DRAFTERS)
def test_greedy_tokens_equal_transformers(drafter, setting, reference, checkpoint_factory, tmp_path_factory):
    path, expected = reference
    tokens, llm = run(path, drafter_config(drafter, checkpoint_factory, tmp_path_factory), **SETTINGS[setting])
    assert tokens == expected
    stats = llm.engine.speculation_stats()
    assert stats.num_draft_tokens > 0, "nothing was drafted: the test would not exercise verification"
    if drafter == "draft-model-self":
        assert stats.num_accepted_tokens == stats.num_draft_tokens
        assert stats.mean_tokens_per_step > 2
    if setting == "tight-pool":
        assert llm.engine.scheduler.stats().num_preemptions > 0


@pytest.mark.parametrize("drafter", ["ngram-dynamic", "draft-model-self-dynamic", "medusa-dynamic"])
def test_dynamic_length_keeps_greedy_tokens(drafter, reference, checkpoint_factory, tmp_path_factory):
    """Dynamic speculation length changes how many drafts each sequence verifies, never the
    tokens; with every draft accepted (the target drafting for itself) it keeps drafting."""
    path, expected = reference
    tokens, llm = run(path, drafter_config(drafter, checkpoint_factory, tmp_path_factory),
                      **SETTINGS["chunked-prefill"])
    assert tokens == expected
    stats = llm.engine.speculation_stats()
    assert stats.num_draft_tokens > 0
    if drafter == "draft-model-self-dynamic":
        assert stats.num_accepted_tokens == stats.num_draft_tokens and stats.mean_tokens_per_step > 1.5


@pytest.mark.parametrize("allocator", ["naive", "radix"])
def test_rollback_in_every_allocator(allocator, reference, checkpoint_factory, tmp_path_factory):
    path, expected = reference
    tokens, llm = run(path, drafter_config("ngram", checkpoint_factory, tmp_path_factory),
                      **{"allocator.name": allocator})
    assert tokens == expected
    stats = llm.engine.speculation_stats()
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # both paths: accept and roll back


def test_request_metrics_count_drafts(reference, checkpoint_factory, tmp_path_factory):
    path, _ = reference
    llm = LLM(path, config={"drafter": drafter_config("ngram", checkpoint_factory, tmp_path_factory)},
              max_model_len=128)
    out = llm.generate(spec_prompts()[0], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
    metrics = out.metrics
    assert metrics.num_draft_tokens >= metrics.num_accepted_tokens > 0
    assert metrics.num_sampling_steps < 24  # fewer target steps than tokens
    assert out.mean_tokens_per_step == pytest.approx(24 / metrics.num_sampling_steps)
    assert metrics.acceptance_rate == metrics.num_accepted_tokens / metrics.num_draft_tokens


def test_step_reports_carry_draft_counts(reference, checkpoint_factory, tmp_path_factory):
    import servelab

    path, _ = reference
    reports = []

    class Observer:
        @servelab.hookimpl
        def servelab_step_finished(self, engine, report):
            reports.append(report)

    llm = LLM(path, config={"drafter": drafter_config("ngram", checkpoint_factory, tmp_path_factory)},
              max_model_len=128)
    llm.engine.registry.register(Observer())
    llm.generate(spec_prompts()[:3], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    stats = llm.engine.speculation_stats()
    assert sum(r.num_draft_tokens for r in reports) == stats.num_draft_tokens > 0
    assert sum(r.num_accepted_tokens for r in reports) == stats.num_accepted_tokens


def test_drafts_stop_at_max_tokens_and_stop_tokens(reference, checkpoint_factory, tmp_path_factory):
    path, expected = reference
    config = {"drafter": drafter_config("draft-model-self", checkpoint_factory, tmp_path_factory)}
    llm = LLM(path, config=config, max_model_len=128)
    out = llm.generate(spec_prompts()[0], SamplingParams(max_tokens=7, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == expected[0][:7]
    stop = expected[0][3]
    first_stop = expected[0].index(stop)
    out = llm.generate(spec_prompts()[0], SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop]))[0]
    assert out.token_ids == expected[0][: first_stop + 1] and out.finish_reason == "stop"
    assert llm.engine.allocator.stats().num_used_blocks == 0


def test_drafter_errors_are_clear(checkpoint_factory, tmp_path):
    path = checkpoint_factory("llama")
    with pytest.raises(ConfigError, match="vocabulary"):
        LLM(path, config={"drafter": {"name": "draft-model", "model": checkpoint_factory("qwen2")}})
    with pytest.raises(ConfigError, match="medusa.safetensors"):
        LLM(path, config={"drafter": {"name": "medusa", "heads": str(tmp_path)}})
    with pytest.raises(ConfigError, match="only 3 Medusa heads"):
        LLM(path, config={"drafter": {"name": "medusa", "heads": medusa_heads(tmp_path, 72),
                                      "num_speculative_tokens": 5}})
    short = tmp_path / "short-draft"
    shutil.copytree(checkpoint_factory("llama-draft"), short)
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 64}))
    with pytest.raises(ConfigError, match="handles 64 positions, fewer than max_model_len=128"):
        LLM(path, config={"drafter": {"name": "draft-model", "model": str(short)}}, max_model_len=128)
    with pytest.raises(PluginError, match="unknown drafter .nope.; installed: ngram"):
        LLM(path, config={"drafter": {"name": "nope"}})
    with pytest.raises(ConfigError, match="min_ngram"):
        LLM(path, config={"drafter": {"name": "ngram", "min_ngram": 3, "max_ngram": 2}})


def perturbed_copy(path: str, directory) -> str:
    """The target with noise on every weight: a draft model whose q overlaps p without
    equalling it, so that acceptance, rejection and the residual all matter."""
    import shutil

    from safetensors.torch import load_file, save_file

    generator = torch.Generator().manual_seed(5)
    tensors = load_file(f"{path}/model.safetensors")
    save_file({name: t + 0.03 * torch.randn(t.shape, generator=generator) for name, t in tensors.items()},
              str(directory / "model.safetensors"))
    shutil.copy(f"{path}/config.json", directory / "config.json")
    return str(directory)


def _second_and_third_tokens(path: str, drafter: dict | None, prompt: list[int], num_requests: int) -> torch.Tensor:
    config = {"drafter": drafter} if drafter else {}
    # The radix cache computes the shared prompt once.
    llm = LLM(path, config=config, max_model_len=128, max_num_seqs=64, **{"allocator.name": "radix"})
    # Unseeded: a seeded request is not drafted (its tokens must not depend on the batch);
    # the engine's own generator (seeded by [engine] seed) keeps the run reproducible.
    params = [SamplingParams(max_tokens=3, temperature=1.0, top_k=4, ignore_eos=True) for _ in range(num_requests)]
    outputs = llm.generate([prompt] * num_requests, params)
    if drafter is not None:
        stats = llm.engine.speculation_stats()
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    return torch.tensor([o.token_ids[1] * VOCAB + o.token_ids[2] for o in outputs])


@pytest.mark.parametrize("drafter", ["draft-model", "ngram"])
def test_seeded_sampling_keeps_the_target_distribution(drafter, checkpoint_factory, tmp_path):
    """Tokens 2 and 3 (the first ones produced by verification) with speculation and
    without: a chi-square test of homogeneity over their joint values, the engine's fixed seed."""
    path = checkpoint_factory("llama")
    start = spec_prompts()[1]
    # The target's own greedy continuation, twice: lookup proposes tokens the target finds likely.
    own = hf_greedy(path, start, 24)
    prompt = start + own + start + own[:2]
    config = ({"name": "ngram", "num_speculative_tokens": 2} if drafter == "ngram" else
              {"name": "draft-model", "model": perturbed_copy(path, tmp_path), "num_speculative_tokens": 2})
    num = 1500
    plain = _second_and_third_tokens(path, None, prompt, num)
    spec = _second_and_third_tokens(path, config, prompt, num)
    values = torch.cat([plain, spec]).unique()
    counts = torch.stack([(plain[:, None] == values).sum(0), (spec[:, None] == values).sum(0)]).double()
    # Pool rare outcomes so every expected count is >= 5.
    expected = counts.sum(0, keepdim=True) * counts.sum(1, keepdim=True) / counts.sum()
    rare = expected.min(0).values < 5
    counts = torch.cat([counts[:, ~rare], counts[:, rare].sum(1, keepdim=True)], dim=1)
    expected = counts.sum(0, keepdim=True) * counts.sum(1, keepdim=True) / counts.sum()
    stat = ((counts - expected) ** 2 / expected).sum()
    dof = counts.shape[1] - 1
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))
    assert dof >= 3, "the distribution is too concentrated to test anything"
    assert p_value > 1e-3


# ---------------------------------------------------------------- conformance


class TestNgram(DrafterContract):
    lookup_drafter = True
    plugin_name = "ngram"


class TestDraftModel(DrafterContract):
    """Built inside a real engine on the tiny model, which gives the drafter a loader."""

    plugin_name = "draft-model"
    deterministic = False  # the contract's sequences sample (temperature 1)
    num_speculative_tokens = 3

    def drafter(self):
        from servelab.testing.tiny_model import tiny_checkpoint

        config = {"drafter": {"name": "draft-model", "model": tiny_checkpoint("llama-draft"),
                              "num_speculative_tokens": self.num_speculative_tokens}}
        return LLM(tiny_checkpoint("llama"), config=config, max_model_len=self.max_model_len).engine.speculator.drafter


class TestMedusa(DrafterContract):
    """Proposes only with the target's hidden states, which the contract's direct calls
    lack: the contract checks the well-formedness of that path; the end-to-end tests above
    verify its drafts."""

    plugin_name = "medusa"
    num_speculative_tokens = 3  # one per head: its options' 0 means "as many as there are heads"

    @pytest.fixture(autouse=True)
    def _heads(self, tmp_path_factory):
        if not hasattr(type(self), "heads"):
            type(self).heads = medusa_heads(tmp_path_factory.mktemp("medusa-contract"), 72)

    def drafter(self):
        from servelab.testing.tiny_model import tiny_checkpoint

        engine = LLM(tiny_checkpoint("llama"), config={"drafter": {"name": "medusa", "heads": self.heads}},
                     max_model_len=self.max_model_len).engine
        return engine.speculator.drafter


class TestEagle(DrafterContract):
    """Built in a real engine on the tiny model (the drafter reads its embeddings and LM
    head); the contract shows it features before each proposal."""

    plugin_name = "eagle"
    feature_size = 72  # one feature layer of the tiny model's hidden size
    num_speculative_tokens = 3
    eagle_options: dict = {"num_speculative_tokens": 3}

    @pytest.fixture(autouse=True)
    def _heads(self, tmp_path_factory):
        if not hasattr(type(self), "heads"):
            from servelab.testing.tiny_model import tiny_checkpoint

            type(self).heads = eagle_head(tmp_path_factory.mktemp("eagle-contract"), tiny_checkpoint("llama"))

    def drafter(self):
        from servelab.testing.tiny_model import tiny_checkpoint

        engine = LLM(tiny_checkpoint("llama"), config={"drafter": {"name": "eagle", "heads": self.heads,
                                                                  **self.eagle_options}},
                     max_model_len=self.max_model_len).engine
        return engine.speculator.drafter


class TestEagleTree(TestEagle):
    eagle_options = {"num_speculative_tokens": 3, "tree_nodes": 8, "tree_top_k": 3}


def test_medusa_proposes_from_hidden_states(checkpoint_factory, tmp_path):
    from servelab.testing.drafter import decoding_sequence

    llm = LLM(checkpoint_factory("llama"), config={"drafter": {"name": "medusa", "heads": medusa_heads(tmp_path, 72)}})
    drafter = llm.engine.speculator.drafter
    seqs = [decoding_sequence("a", [5, 6, 7], [8]), decoding_sequence("b", [9], [])]
    proposals = drafter.propose(seqs, hidden_states=torch.randn(2, 72))
    assert set(proposals) == {"a", "b"} and all(len(d) == 3 for d in proposals.values())
    assert all(0 <= t < VOCAB for d in proposals.values() for t in d)


def test_parallel_sampling_with_drafts(reference, checkpoint_factory, tmp_path_factory):
    """n = 3 greedy completions fork after the prefill, then each drafts and rolls back on
    its own copy-on-write blocks: all three equal the single greedy completion."""
    path, expected = reference
    llm = LLM(path, config={"drafter": drafter_config("ngram", checkpoint_factory, tmp_path_factory)},
              max_model_len=128, block_size=8)
    outputs = llm.generate(spec_prompts()[:3], [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, n=3)
                                                for n in MAX_NEW[:3]])
    assert [[c.token_ids for c in o.outputs] for o in outputs] == [[e] * 3 for e in expected[:3]]
    assert llm.engine.speculation_stats().num_accepted_tokens > 0
    assert llm.engine.allocator.stats().num_used_blocks == 0


def test_bench_reports_acceptance(llama_checkpoint, tmp_path):
    from servelab.bench.metrics import SLO
    from servelab.bench.session import BenchOptions, run_bench
    from servelab.config import EngineConfig

    base = EngineConfig().with_overrides({"engine.model": llama_checkpoint, "engine.max_model_len": 128})
    spec = EngineConfig.from_dict({"engine": {"model": llama_checkpoint, "max_model_len": 128},
                                   "drafter": {"name": "ngram"}})
    options = BenchOptions(workload="repetitive:passage_len=40,num_requests=4,output_len=24", repeats=1,
                           slo=SLO(ttft_ms=1e9, tpot_ms=1e9))
    result = run_bench([("plain", base), ("ngram", spec)], options)
    plain, ngram = (run["metrics"] for run in result["runs"])
    assert plain["acceptance_rate"] is None and plain["tokens_per_target_step"] == pytest.approx(1.0)
    assert ngram["draft_tokens"] >= ngram["accepted_tokens"] > 0
    assert ngram["tokens_per_target_step"] > 1.0
    assert ngram["output_tokens"] == plain["output_tokens"]


def test_server_metrics_export_the_acceptance_rate(reference, checkpoint_factory, tmp_path_factory):
    pytest.importorskip("prometheus_client")
    from servelab.server.metrics import EngineObserver, ServerMetrics

    path, _ = reference
    metrics = ServerMetrics()
    llm = LLM(path, config={"drafter": drafter_config("ngram", checkpoint_factory, tmp_path_factory)},
              max_model_len=128)
    llm.engine.registry.register(EngineObserver(metrics))
    llm.generate(spec_prompts()[:2], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    stats = llm.engine.speculation_stats()
    text = metrics.render().decode()
    line = next(row for row in text.splitlines() if row.startswith("servelab_spec_decode_acceptance_rate "))
    assert float(line.split()[1]) == pytest.approx(stats.acceptance_rate)


def test_a_drafter_proposing_garbage_costs_nothing_but_speed(reference):
    """Out-of-vocabulary or non-integer drafts are dropped (with a warning); the request's
    tokens are still the target's, and nothing leaks."""
    import servelab
    from servelab.plugin_types import DrafterPlugin

    class Garbage:
        def __init__(self, options, context):
            self.calls = 0

        def propose(self, seqs):
            self.calls += 1
            return {seq.request_id: ([VOCAB + 5, 1] if self.calls % 2 else ["x"]) for seq in seqs}

    class Plugin:
        @servelab.hookimpl
        def servelab_register_drafters(self):
            return [DrafterPlugin(name="garbage", factory=Garbage)]

    registry = servelab.PluginRegistry.from_entry_points()
    registry.register(Plugin())
    path, expected = reference
    llm = LLM(path, config={"drafter": {"name": "garbage"}}, registry=registry, max_model_len=128)
    outputs = llm.generate(spec_prompts()[:2], [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
                                                for n in MAX_NEW[:2]])
    assert [o.token_ids for o in outputs] == expected[:2]
    assert llm.engine.speculation_stats().num_draft_tokens == 0
    assert llm.engine.allocator.stats().num_used_blocks == 0


# ---------------------------------------------------------------- the embedded models


@pytest.fixture(scope="module")
def embedded_plain():
    """Greedy tokens of builtin:tiny without speculation, on text that repeats and text that does not."""
    prompts = ["def add(a, b):\n    return a + b\n\ndef add(a, b):\n", "The with statement", "import os\n"]
    llm = LLM("builtin:tiny", max_model_len=256)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    return prompts, [o.token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("drafter", [{"name": "ngram"}, {"name": "suffix"}, {"name": "draft-model"},
                                     {"name": "medusa"}, {"name": "suffix", "dynamic_length": True}],
                         ids=["ngram", "suffix", "draft-model", "medusa", "suffix-dynamic"])
@pytest.mark.parametrize("scheduler", ["continuous", "chunked-prefill"])
def test_embedded_models_greedy_unchanged_by_every_drafter(drafter, scheduler, embedded_plain):
    prompts, expected = embedded_plain
    llm = LLM("builtin:tiny", config={"drafter": drafter}, max_model_len=256,
              **{"scheduler.name": scheduler, "max_num_batched_tokens": 256 if scheduler == "continuous" else 8})
    outputs = llm.generate(prompts, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outputs] == expected
    stats = llm.engine.speculation_stats()
    assert stats.num_accepted_tokens > 0, stats  # trained drafters do get accepted


@pytest.mark.parametrize("name", ["spec-ngram", "spec-suffix", "spec-draft-model", "spec-medusa", "spec-eagle"])
def test_example_configs_run(name):
    from pathlib import Path

    from servelab.config import EngineConfig

    path = Path(__file__).resolve().parent.parent / "examples" / "configs" / f"{name}.toml"
    llm = LLM(config=EngineConfig.load(path))
    out = llm.generate("import os\n", SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 16 and out.metrics.num_draft_tokens > 0


# ---------------------------------------------------------------- seeds and the batch


@pytest.mark.parametrize("drafter", [{"name": "ngram", "num_speculative_tokens": 4, "max_ngram": 3},
                                     {"name": "suffix", "num_speculative_tokens": 4, "max_spec_factor": 2.0}],
                         ids=["ngram", "suffix-dynamic"])
def test_a_seeded_request_gives_the_same_tokens_whatever_else_is_in_the_batch(drafter, checkpoint_factory):
    """Seeded choices alone, and among a crowd of other requests with drafts (which decide
    how many drafts anyone gets, and so how many draws verification takes), and with no
    drafter at all: the same tokens each time."""
    path = checkpoint_factory("llama")
    prompt = spec_prompts()[1] * 2
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=11, n=3, ignore_eos=True)
    crowd = SamplingParams(max_tokens=16, temperature=0.9, ignore_eos=True)
    llm = LLM(path, config={"drafter": drafter}, max_model_len=128, max_num_seqs=16, max_num_batched_tokens=40,
              **{"scheduler.name": "chunked-prefill"})
    alone = [c.token_ids for c in llm.generate([prompt], seeded)[0].outputs]
    others = spec_prompts() * 3
    loaded = llm.generate(others + [prompt], [crowd] * len(others) + [seeded])
    assert llm.engine.speculation_stats().num_draft_tokens > 0  # the crowd was drafted
    assert [c.token_ids for c in loaded[-1].outputs] == alone
    plain = LLM(path, max_model_len=128)
    assert [c.token_ids for c in plain.generate([prompt], seeded)[0].outputs] == alone

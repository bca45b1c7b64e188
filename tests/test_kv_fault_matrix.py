"""The KV fault matrix: every feature that copies or moves KV blocks or slots (parallel
sampling's copy-on-write, prefix sharing, token-tree path moves, swap preemption, the host
tier in memory and in a file) crossed with every KV cache dtype and the CPU attention
backends, greedy output compared with the plain configuration of the same dtype and
backend.

A token's K/V depends only on its own prefix (a quantized row carries its own scale), so a
copy or a move that keeps the bytes keeps the tokens; one that loses them, or an op that
does not exist for the cache's dtype, shows here. Each case also checks that its feature
really moved KV (the copy counted, the tier's moves in its stats), so a pool that happened
to be large enough cannot pass for a working copy path. Combinations that cannot work are
refused at start, by name (the last tests).

Replicas and the multi-process faults (SIGKILL, SIGSTOP of a replica, a stalled grammar
compiler) are in tests/test_server_replicas.py, tests/test_server_units.py and
tests/test_structured_output.py; int8 KV, the host tier and swap served at once in
tests/test_server_kv_hierarchy.py."""

from __future__ import annotations

import random

import pytest

import servelab
from servelab import LLM, SamplingParams
from servelab.interfaces import Draft
from servelab.plugin_types import DrafterPlugin

from test_token_trees import random_tree

KV_DTYPES = ("auto", "int8", "fp8_e4m3", "fp8_e5m2")
BACKENDS = ("torch-paged", "cpu-paged")
FEATURES = ("n2", "prefix", "tree", "swap", "tier", "file-tier")
BLOCK_SIZE = 4
MAX_TOKENS = 6
MAX_MODEL_LEN = 24


def make_prompts() -> list[list[int]]:
    """Two prompts over one shared 13-token system prompt (three full blocks and a partial
    one), one unrelated: prefix hits, shared partial blocks, tier traffic."""
    rng = random.Random(46)
    system = [rng.randrange(3, 200) for _ in range(13)]
    shared = [system + [rng.randrange(3, 200) for _ in range(1 + i)] for i in range(2)]
    return shared + [[rng.randrange(3, 200) for _ in range(11)]]


def greedy(n: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, n=n)


def engine(path: str, kv_cache_dtype: str, backend: str, config: dict | None = None, registry=None,
           **options) -> LLM:
    extra = {"attention.build": "wait"} if backend == "cpu-paged" else {}
    return LLM(path, config=config, registry=registry, kv_cache_dtype=kv_cache_dtype, max_model_len=MAX_MODEL_LEN,
               block_size=BLOCK_SIZE, **{"attention.name": backend, **extra, **options})


def oracle_trees(truths: dict[tuple[int, ...], list[int]]):
    """A registry with drafter 'oracle-tree': random trees (the true continuation on one
    branch, at a random place in the node list) so that accepted paths move slots."""

    class OracleTree:
        proposes_trees = True

        def __init__(self, options, context):
            self.vocab = context.vocab_size
            self.rng = random.Random(7)

        def propose(self, seqs):
            proposals = {}
            for seq in seqs:
                truth = truths[tuple(seq.prompt_token_ids)][len(seq.output_token_ids):]
                tokens, parents, _ = random_tree(self.rng, truth, 3, self.vocab)
                proposals[seq.request_id] = Draft(tokens, parents=parents)
            return proposals

    class Plugin:
        @servelab.hookimpl
        def servelab_register_drafters(self):
            return [DrafterPlugin(name="oracle-tree", factory=OracleTree, contract_version=3)]

    registry = servelab.PluginRegistry.from_entry_points()
    registry.register(Plugin())
    return registry


class CopyCounter:
    """Counts the block copies and slot moves the runner performs (the real ones run)."""

    def __init__(self, llm: LLM) -> None:
        self.copied_blocks = 0
        self.moved_slots = 0
        runner, speculator = llm.engine.runner, llm.engine.speculator
        copy_blocks, move_slots = runner.copy_blocks, runner.move_slots

        def counted_copy(copies):
            self.copied_blocks += len(copies)
            return copy_blocks(copies)

        def counted_move(moves):
            self.moved_slots += len(moves)
            return move_slots(moves)

        runner.copy_blocks = counted_copy
        if speculator is not None:
            speculator.slot_mover = counted_move


def one_at_a_time(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [llm.generate([prompt], greedy())[0].token_ids for prompt in prompts]


@pytest.fixture(scope="module")
def plain(llama_checkpoint):
    """(dtype, backend) -> each prompt's greedy tokens on a roomy pool, one request at a time."""
    cache: dict[tuple[str, str], list[list[int]]] = {}

    def get(kv_cache_dtype: str, backend: str) -> list[list[int]]:
        if (kv_cache_dtype, backend) not in cache:
            llm = engine(llama_checkpoint, kv_cache_dtype, backend, max_num_seqs=1)
            cache[kv_cache_dtype, backend] = one_at_a_time(llm, make_prompts())
        return cache[kv_cache_dtype, backend]

    return get


def run_feature(feature: str, path: str, kv_cache_dtype: str, backend: str, reference: list[list[int]], tmp_path):
    """The feature's tokens for make_prompts() in prompt order, and the engine it ran on."""
    prompts = make_prompts()
    if feature == "n2":
        llm = engine(path, kv_cache_dtype, backend, max_num_seqs=4)
        counter = CopyCounter(llm)
        outputs = llm.generate(prompts, greedy(n=2))
        choices = [[choice.token_ids for choice in output.outputs] for output in outputs]
        assert all(len(c) == 2 for c in choices)
        assert counter.copied_blocks > 0, "no copy-on-write happened"
        return [c[0] for c in choices] + [c[1] for c in choices], llm
    if feature == "prefix":
        llm = engine(path, kv_cache_dtype, backend, max_num_seqs=1, **{"allocator.name": "radix"})
        tokens = one_at_a_time(llm, prompts)  # the second prompt hits the first one's system prompt
        assert llm.engine.allocator.stats().prefix_hit_tokens > 0
        return tokens, llm
    if feature == "tree":
        registry = oracle_trees({tuple(p): r for p, r in zip(prompts, reference)})
        llm = engine(path, kv_cache_dtype, backend, config={"drafter": {"name": "oracle-tree"}}, registry=registry,
                     max_num_seqs=4)
        counter = CopyCounter(llm)
        tokens = [o.token_ids for o in llm.generate(prompts, greedy())]
        assert counter.moved_slots > 0, "no accepted path needed its slots moved"
        return tokens, llm
    if feature == "swap":
        # 7 blocks (28 tokens) for three requests of up to 21 tokens: preemption by swapping.
        llm = engine(path, kv_cache_dtype, backend, max_num_seqs=3, num_kv_blocks=7, max_num_batched_tokens=64,
                     **{"scheduler.preemption_mode": "swap", "kv_offload.host_blocks": 40})
        tokens = [o.token_ids for o in llm.generate(prompts, greedy())]
        tier = llm.engine.host_tier.stats()
        assert tier.num_swap_outs > 0 and tier.num_swap_ins == tier.num_swap_outs
        return tokens, llm
    tier_options = {"kv_offload.host_blocks": 40}
    if feature == "file-tier":
        tier_options["kv_offload.path"] = str(tmp_path / "host-tier.bin")
    # 6 device blocks hold one request at a time: the unrelated prompt, run second, pushes
    # the system prompt's blocks down to the host tier; the third prompt brings them back.
    llm = engine(path, kv_cache_dtype, backend, max_num_seqs=1, num_kv_blocks=6,
                 **{"allocator.name": "radix", **tier_options})
    order = [0, 2, 1]
    tokens = one_at_a_time(llm, [prompts[i] for i in order])
    tier = llm.engine.host_tier.stats()
    assert tier.num_offloads > 0 and tier.host_hit_blocks > 0
    return [tokens[order.index(i)] for i in range(len(prompts))], llm


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
@pytest.mark.parametrize("feature", FEATURES)
def test_kv_copies_and_moves_keep_greedy_output(llama_checkpoint, plain, tmp_path, feature, kv_cache_dtype,
                                                backend):
    reference = plain(kv_cache_dtype, backend)
    tokens, llm = run_feature(feature, llama_checkpoint, kv_cache_dtype, backend, reference, tmp_path)
    expected = reference + reference if feature == "n2" else reference
    assert tokens == expected
    assert llm.engine.allocator.stats().num_used_blocks == 0, "blocks leaked after every request finished"


# ---------------------------------------------------------------- combinations refused at start

REFUSED = {
    # a backend without the quantized cache layout
    "quantized-kv-on-sdpa-contiguous": ({"kv_cache_dtype": "fp8_e4m3", "attention.name": "sdpa-contiguous",
                                         "allocator.name": "naive"},
                                        r"kv_cache_dtype='fp8_e4m3': attention 'sdpa-contiguous' cannot store"),
    # token trees need tree masks
    "trees-on-sdpa-contiguous": ({"attention.name": "sdpa-contiguous", "allocator.name": "naive",
                                  "drafter.name": "suffix", "drafter.tree_nodes": 4},
                                 r"proposes token trees, but attention backend 'sdpa-contiguous'"),
    # swap keeps the victims' KV in the host tier
    "swap-without-a-host-tier": ({"scheduler.preemption_mode": "swap"}, r"preemption_mode = \"swap\""),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_unsupported_combinations_are_refused_at_start_by_name(llama_checkpoint, case):
    from servelab.errors import ConfigError

    options, message = REFUSED[case]
    with pytest.raises(ConfigError, match=message):
        LLM(llama_checkpoint, max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE, **options)


def test_two_engines_on_one_host_tier_file_are_refused_by_name(llama_checkpoint, tmp_path):
    from servelab.errors import ConfigError

    options = {"allocator.name": "radix", "kv_offload.host_blocks": 8, "kv_offload.path": str(tmp_path / "kv.bin")}
    first = engine(llama_checkpoint, "fp8_e5m2", "torch-paged", **options)
    with pytest.raises(ConfigError, match=r"is in use by another engine"):
        engine(llama_checkpoint, "fp8_e5m2", "torch-paged", **options)
    assert first.generate([make_prompts()[0]], greedy())[0].token_ids

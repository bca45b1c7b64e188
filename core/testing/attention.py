"""AttentionBackendContract: every backend computes what dense causal attention computes.

    from servelab.testing import AttentionBackendContract

    class TestMine(AttentionBackendContract):
        factory = MyBackend
        device = "cuda"                 # where its tensors live (skipped when absent)
        dtypes = ("float32", "bfloat16")

Shapes cover GQA ratios 1, 2, 4 and 8, several head sizes and block sizes (1 included),
ragged contexts, prompts, chunks and decodes in one batch, shuffled block tables and
block copies; tolerance follows the dtype (1e-4 for float32, 1e-2 float16, 2e-2 bfloat16).
"""

from __future__ import annotations

import pytest

from servelab.testing.contract import PolicyContract
from servelab.testing.attention_pairing import needs_contiguous_tables

GQA = [(4, 4), (4, 2), (8, 2), (8, 1)]  # (query heads, KV heads): ratios 1, 2, 4, 8
# (tokens already cached, new tokens): a prefill, decodes, chunks on top of a cache, a
# sequence of one token, contexts ending on and off block boundaries.
SHAPES = [(0, 7), (12, 1), (5, 1), (33, 5), (0, 1), (40, 1), (17, 9), (15, 1)]


class AttentionBackendContract(PolicyContract):
    """Invariants (each failure message starts "invariant violated: <name>"):

    - kv_cache_block_dim() indexes the cache's blocks (kv_cache_shape() has num_blocks there)
    - attention output equals dense causal attention (within dtype tolerance), for a
      cached prefix, a mixed batch of prompts, chunks and decodes, and decodes after block
      copies along kv_cache_block_dim(), with any `scale`
    - forward writes only the slots of the slot mapping
    - a TreeAttentionBackend's token-tree rows attend to the context and their own root
      path, equal to masked attention computed with an explicit mask (attention_tree.py)
    - tokens identical to the reference policies, end to end on a tiny model (float32)

    A backend declaring `requires_contiguous_block_tables` (it reads a sequence's K/V as
    one slice of the cache) gets contiguous tables, runs moved whole by block copies, and
    runs end to end with the contiguous allocator `naive` (see attention_batch.py).
    """

    kind = "attention"
    device = "cpu"
    dtypes = ("float32",)
    max_examples = 20

    @pytest.fixture(autouse=True)
    def _servelab_device(self):
        import torch

        if torch.device(self.device).type == "cuda" and not torch.cuda.is_available():
            pytest.skip("needs CUDA")

    def check_batch(self, *, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                    shapes: list[tuple[int, int]], scale: float | None = None, seed: int = 0) -> None:
        import torch

        from servelab.testing.attention_batch import BatchCheck

        for dtype in self.dtypes:
            BatchCheck(self.make, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                       block_size=block_size, shapes=shapes, dtype=getattr(torch, dtype), device=self.device,
                       scale=head_dim ** -0.5 if scale is None else scale, seed=seed).run()

    # ------------------------------------------------------------ fixed shapes

    @pytest.mark.parametrize("num_heads,num_kv_heads", GQA)
    @pytest.mark.parametrize("head_dim", [12, 64])
    @pytest.mark.parametrize("block_size", [1, 4, 16])
    def test_mixed_batch_matches_dense_attention(self, num_heads, num_kv_heads, head_dim, block_size):
        self.check_batch(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
                         shapes=SHAPES, seed=num_heads * 100 + head_dim + block_size)

    def test_single_decode(self):
        self.check_batch(num_heads=2, num_kv_heads=1, head_dim=8, block_size=4, shapes=[(0, 1)])

    # ------------------------------------------------------------ random batches

    def test_random_batches(self):
        import hypothesis.strategies as st
        from hypothesis import given

        shapes = st.lists(st.tuples(st.integers(0, 40), st.integers(1, 9)), min_size=1, max_size=6)

        @self.hypothesis_settings()
        @given(heads=st.sampled_from(GQA), head_dim=st.sampled_from([4, 8, 12, 16, 32]),
               block_size=st.sampled_from([1, 2, 3, 4, 8, 16]), shapes=shapes,
               scale=st.sampled_from([None, 0.5, 0.05]), seed=st.integers(0, 2**16))
        def run(heads, head_dim, block_size, shapes, scale, seed):
            self.check_batch(num_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim, block_size=block_size,
                             shapes=shapes, scale=scale, seed=seed)

        run()

    # ------------------------------------------------------------ token trees

    @pytest.mark.parametrize("num_heads,num_kv_heads", GQA)
    @pytest.mark.parametrize("block_size", [1, 4, 16])
    @pytest.mark.parametrize("seed", [0, 1, 2])
    def test_token_trees_match_masked_attention(self, num_heads, num_kv_heads, block_size, seed):
        """Only for a TreeAttentionBackend: random token trees beside decodes and chunks."""
        import torch

        from servelab.interfaces import AttentionContext, TreeAttentionBackend
        from servelab.testing.attention_tree import TreeBatchCheck

        probe = self.make(AttentionContext(num_heads=2, num_kv_heads=1, head_dim=8, block_size=4, num_blocks=4,
                                           dtype=torch.float32, device=torch.device(self.device)))
        if not (isinstance(probe, TreeAttentionBackend) and probe.supports_tree_attention):
            pytest.skip("not a TreeAttentionBackend")
        for dtype in self.dtypes:
            TreeBatchCheck(self.make, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=16,
                           block_size=block_size, dtype=getattr(torch, dtype), device=self.device,
                           seed=seed * 1000 + num_heads * 10 + block_size).run()

    # ------------------------------------------------------------ end to end

    @pytest.mark.parametrize("case", ["roomy", "tight"])
    def test_greedy_tokens_match_the_reference_policies(self, case):
        from servelab.testing.e2e import check_against_reference

        import torch

        from servelab.interfaces import AttentionContext

        name, registry = self.policy_section()
        probe = self.make(AttentionContext(num_heads=2, num_kv_heads=1, head_dim=8, block_size=4, num_blocks=4,
                                           dtype=torch.float32, device=torch.device(self.device)))
        partners = {"allocator": "naive"} if needs_contiguous_tables(probe) else None
        check_against_reference(self.kind, name, registry, case, partners=partners, device=self.device)


__all__ = ["AttentionBackendContract"]

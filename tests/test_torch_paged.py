"""The torch-paged backend passes the attention contract (dense causal attention over
GQA ratios 1-8, head and block sizes, ragged mixed batches, shuffled block tables and
block copies), with group sizes that put every sequence in its own group, split groups
unevenly, and batch everyone together."""

from __future__ import annotations

from servelab.plugins.kernels.options import TorchPagedOptions
from servelab.testing import AttentionBackendContract


class TestTorchPaged(AttentionBackendContract):
    plugin_name = "torch-paged"


class TestTorchPagedGroupsOfOne(AttentionBackendContract):
    plugin_name = "torch-paged"
    options = TorchPagedOptions(decode_group_size=1, prefill_group_size=1)


class TestTorchPagedGroupsOfThree(AttentionBackendContract):
    plugin_name = "torch-paged"
    options = TorchPagedOptions(decode_group_size=3, prefill_group_size=3)

"""servelab.testing: the conformance suite every policy, built-in or third-party, passes.

    from servelab.testing import AllocatorContract

    class TestMine(AllocatorContract):
        factory = make_mine              # factory(options, context) -> policy
        # or: plugin_name = "mine"       # the installed policy of that name

Each contract is a plain class whose `test_*` methods every `Test*` subclass inherits:
scenario tests, hypothesis tests over random operation sequences, and end-to-end runs on
a tiny model whose greedy tokens must equal the reference policies'. A broken invariant
fails with "invariant violated: <name>". The contracts need the `test` extra
(pytest, hypothesis, transformers); the pytest plugin (`servelab.testing.plugin`,
loaded through the pytest11 entry point) adds `--servelab-max-examples` and a
`servelab_tiny_checkpoint` fixture.
"""

from servelab.testing.allocator import AllocatorContract
from servelab.testing.attention import AttentionBackendContract
from servelab.testing.contract import ContractViolation, check
from servelab.testing.adapter_residency import AdapterResidencyContract
from servelab.testing.drafter import DrafterContract
from servelab.testing.eviction import EvictionContract
from servelab.testing.kv_tier import KVTierContract
from servelab.testing.kv_transfer import TransportContract
from servelab.testing.logits_processor import LogitsProcessorContract
from servelab.testing import objectives
from servelab.testing.objectives import Objective, ObjectiveMissed
from servelab.testing.router import RouterContract
from servelab.testing.scheduler import SchedulerContract
from servelab.testing.scheduler_harness import SchedulerHarness
from servelab.testing.scheduler_workloads import make_allocator
from servelab.testing.victim import VictimContract

__all__ = [
    "AdapterResidencyContract",
    "AllocatorContract",
    "AttentionBackendContract",
    "ContractViolation",
    "DrafterContract",
    "EvictionContract",
    "KVTierContract",
    "TransportContract",
    "LogitsProcessorContract",
    "Objective",
    "ObjectiveMissed",
    "RouterContract",
    "SchedulerContract",
    "SchedulerHarness",
    "VictimContract",
    "check",
    "make_allocator",
    "objectives",
]

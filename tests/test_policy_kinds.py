"""The policy kinds table: every per-kind name (hook, config section, defaults, error
words, record class) is read off it, so a kind added to a copy of the table works end
to end in a registry; and every registration hookspec's example plugin runs."""

from __future__ import annotations

import inspect
import textwrap
import types
import typing

import attrs
import pytest

import servelab
from servelab import config, hookspecs
from servelab.errors import ConfigError, PluginError
from servelab.interfaces import (AllocatorContext, AllocatorStats, DrafterContext, KVAllocator, RouteRequest, Router,
                                 RouterContext, ReplicaSnapshot, Scheduler, SchedulerContext, Sequence, SequenceStatus)
from servelab.plugin_types import KINDS, POLICY_KINDS, PolicyKind, PolicyPlugin, kind_of_section, kinds_table
from servelab.registry import PluginRegistry, RegisteredPolicy, build_policy
from servelab.sampling_params import SamplingParams
from servelab.testing import DrafterContract


class Gizmo(typing.Protocol):
    def spin(self) -> int: ...


@attrs.frozen
class GizmoContext:
    speed: int


GIZMOS = PolicyKind("gizmos", "gizmo", "gizmo widget", "GizmoPlugin", Gizmo, GizmoContext, default="plain")


class GizmoSpecs:
    @hookspecs.hookspec
    def servelab_register_gizmos(self) -> list:
        """Return GizmoPlugin records."""


class Spinner:
    def __init__(self, options, context: GizmoContext):
        self.speed = context.speed

    def spin(self) -> int:
        return self.speed


def plugin_returning(hook: str, *records):
    class Plugin:
        pass

    setattr(Plugin, hook, servelab.hookimpl(lambda self: list(records)))
    return Plugin()


def test_a_new_kind_in_a_copy_of_the_table_gets_its_hook_section_record_and_words():
    kinds = kinds_table([*KINDS.values(), GIZMOS])
    assert GIZMOS.hook_name == "servelab_register_gizmos"
    assert kind_of_section("gizmo", kinds) is GIZMOS
    assert GIZMOS.record.__name__ == "GizmoPlugin" and issubclass(GIZMOS.record, PolicyPlugin)
    assert "GizmoContext" in GIZMOS.record.__doc__ and "Gizmo" in GIZMOS.record.__doc__

    registry = PluginRegistry(kinds=kinds, specs=(hookspecs, GizmoSpecs))
    registry.register(plugin_returning(GIZMOS.hook_name, GIZMOS.record(name="plain", factory=Spinner)), "dist-a")
    selected = registry.select("gizmos", "plain")
    assert selected.kind == "gizmos" and selected.distribution == "dist-a"
    assert build_policy(selected, None, GizmoContext(speed=3)).spin() == 3
    assert [entry["name"] for entry in registry.describe()["gizmos"]] == ["plain"]
    with pytest.raises(PluginError, match=r"unknown gizmo widget 'fancy'; installed: plain \(dist-a\)"):
        registry.select("gizmos", "fancy")

    registry.register(plugin_returning(GIZMOS.hook_name, GIZMOS.record(name="plain", factory=Spinner)), "dist-b")
    with pytest.raises(PluginError, match="two plugins register the gizmo widget 'plain'"):
        registry.select("gizmos", "plain")
    assert registry.select("gizmos", "dist-b:plain").distribution == "dist-b"

    broken = RegisteredPolicy("gizmos", GIZMOS.record(name="broken", factory="no_such_module_xyz:G"), "dist-c",
                              GIZMOS.noun)
    with pytest.raises(PluginError, match="gizmo widget 'broken' from distribution 'dist-c' failed to load"):
        build_policy(broken, None, GizmoContext(speed=1))


def test_a_kind_without_its_hookspec_is_refused_by_name():
    with pytest.raises(PluginError, match="servelab_register_gizmos"):
        PluginRegistry(kinds=kinds_table([*KINDS.values(), GIZMOS]))


def test_the_table_refuses_a_key_or_section_used_twice():
    with pytest.raises(PluginError, match="clashes with 'allocators'"):
        kinds_table([*KINDS.values(), attrs.evolve(GIZMOS, section="allocator")])
    with pytest.raises(PluginError, match=r"no policy kind has the config section \[gizmo\]"):
        kind_of_section("gizmo")


def test_the_old_names_are_read_off_the_table():
    assert POLICY_KINDS == ("allocators", "schedulers", "drafters", "attention", "routers", "logits_processors",
                            "evictors", "victims", "kv_transfers", "adapter_residency")
    assert config.POLICY_SECTIONS == ("allocator", "scheduler", "drafter", "attention", "router", "eviction",
                                      "kv_transfer", "adapter_residency")
    assert config.DEFAULT_POLICIES == {"allocator": "paged", "scheduler": "continuous", "attention": "cpu-paged",
                                       "eviction": "lru", "adapter_residency": "lru"}
    assert config.DEFAULT_ROUTER == "round-robin"
    assert [kind.noun for kind in KINDS.values()] == ["allocator", "scheduler", "drafter", "attention backend",
                                                      "router", "logits processor", "eviction policy",
                                                      "preemption victim", "KV transport",
                                                      "adapter residency policy"]
    defaults = config.EngineConfig()
    for kind in KINDS.values():
        assert getattr(servelab.plugin_types, kind.record_name) is kind.record
        if kind.selectable:
            section = getattr(defaults, kind.section)
            assert (section is None) if kind.optional else (section.name == kind.default)
            chosen = config.EngineConfig.from_dict({kind.section: {"name": "x"}})
            assert getattr(chosen, kind.section).name == "x"


def test_a_kind_another_kind_selects_has_no_section_of_its_own():
    assert KINDS["victims"].selected_by == "[scheduler] preemption"
    assert "preemption" not in config.SECTIONS
    with pytest.raises(ConfigError, match="unknown config section"):
        config.EngineConfig.from_dict({"preemption": {"name": "newest"}})


def test_each_kind_names_its_contract_module():
    assert {key: kind.contract for key, kind in KINDS.items()} == {
        "allocators": "servelab.contracts.allocator", "schedulers": "servelab.contracts.scheduler",
        "drafters": "servelab.contracts.drafter", "attention": "servelab.contracts.attention",
        "routers": "servelab.contracts.router", "logits_processors": "servelab.contracts.logits_processor",
        "evictors": "servelab.contracts.eviction", "victims": "servelab.contracts.victim",
        "kv_transfers": "servelab.contracts.kv_transfer",
        "adapter_residency": "servelab.contracts.adapter_residency"}


def test_every_kind_has_a_typed_registration_hookspec():
    for kind in KINDS.values():
        spec = getattr(hookspecs, kind.hook_name)
        assert inspect.signature(spec).return_annotation == f"list[{kind.record_name}]", kind.key


def example_plugin(kind: PolicyKind) -> dict:
    """The plugin module a hookspec's docstring shows, executed."""
    doc = getattr(hookspecs, kind.hook_name).__doc__
    code = textwrap.dedent(doc.split("A complete plugin")[1].split("::\n", 1)[1])
    namespace: dict = {}
    exec(compile(code, f"<{kind.hook_name} example>", "exec"), namespace)
    return namespace


def selected_example(kind: PolicyKind) -> RegisteredPolicy:
    """The example's policy, registered as a module and selected by name."""
    module = types.ModuleType(f"example_{kind.key}")
    module.__dict__.update(example_plugin(kind))
    [record] = getattr(module, kind.hook_name)()
    assert isinstance(record, kind.record)
    registry = PluginRegistry()
    registry.register(module)
    return registry.select(kind.key, record.name)


def _options(registered):
    return registered.plugin.options()


def test_the_allocator_example_allocates_all_or_nothing():
    registered = selected_example(KINDS["allocators"])
    allocator = build_policy(registered, _options(registered), AllocatorContext(num_blocks=4, block_size=4,
                                                                                max_model_len=16))
    assert isinstance(allocator, KVAllocator)
    assert allocator.allocate("a", 6) and list(allocator.block_table("a")) == [0, 1]
    assert not allocator.allocate("b", 12) and list(allocator.block_table("b")) == []
    allocator.free("a")
    assert allocator.allocate("b", 12) and list(allocator.block_table("b")) == [0, 1, 2]
    assert allocator.stats() == AllocatorStats(num_blocks=4, num_used_blocks=3, num_free_blocks=1,
                                               num_token_slots_used=12, block_size=4)


def test_the_scheduler_example_runs_requests_one_at_a_time():
    allocators = selected_example(KINDS["allocators"])
    registered = selected_example(KINDS["schedulers"])
    allocator = build_policy(allocators, None, AllocatorContext(num_blocks=8, block_size=4, max_model_len=16))
    scheduler = build_policy(registered, None, SchedulerContext(allocator, max_num_seqs=4, max_num_batched_tokens=8,
                                                                max_model_len=16, clock=lambda: 0.0))
    assert isinstance(scheduler, Scheduler)
    first, second = (Sequence(name, [1, 2, 3], SamplingParams(), 0.0) for name in ("first", "second"))
    scheduler.add(first)
    scheduler.add(second)
    plan = scheduler.schedule()
    assert [(seq.request_id, n) for seq, n in plan.scheduled] == [("first", 3)]
    assert first.status is SequenceStatus.RUNNING and second.status is SequenceStatus.WAITING
    scheduler.finish([first])
    assert [(seq.request_id, n) for seq, n in scheduler.schedule().scheduled] == [("second", 3)]
    assert scheduler.abort("second") is second and not scheduler.has_unfinished()
    assert allocator.stats().num_used_blocks == 0


def test_the_drafter_and_router_examples_work():
    registered = selected_example(KINDS["drafters"])
    drafter = build_policy(registered, _options(registered), DrafterContext(vocab_size=16, max_model_len=4))
    seq = Sequence("r", [5, 6, 7], SamplingParams(), 0.0)
    assert drafter.propose([seq]) == {"r": [7]}  # one position left before max_model_len
    drafter = build_policy(registered, _options(registered), DrafterContext(vocab_size=16, max_model_len=64))
    assert drafter.propose([seq]) == {"r": [7, 7]}

    registered = selected_example(KINDS["routers"])
    router = build_policy(registered, None, RouterContext(num_replicas=2))
    assert isinstance(router, Router)
    replicas = [ReplicaSnapshot(replica_id=0, num_waiting=3), ReplicaSnapshot(replica_id=1, num_waiting=1)]
    assert router.route(RouteRequest("q", [1, 2]), replicas) == 1


def test_the_attention_and_logits_processor_examples_work():
    torch = pytest.importorskip("torch")
    from servelab.interfaces import AttentionContext, LogitsProcessorContext

    registered = selected_example(KINDS["attention"])
    backend = build_policy(registered, None, AttentionContext(num_heads=2, num_kv_heads=1, head_dim=4, block_size=4,
                                                              num_blocks=2, dtype=torch.float32,
                                                              device=torch.device("cpu")))
    assert backend.calls == 0 and len(backend.kv_cache_shape()) == 4

    registered = selected_example(KINDS["logits_processors"])
    processor = build_policy(registered, registered.plugin.options(token_id=2),
                             LogitsProcessorContext(vocab_size=4, eos_token_ids=frozenset()))
    logits = processor.apply(torch.zeros(2, 4), [None, None])
    assert torch.isinf(logits[:, 2]).all() and not torch.isinf(logits[:, [0, 1, 3]]).any()


_DRAFTER_EXAMPLE = example_plugin(KINDS["drafters"])


class TestTheDrafterExampleKeepsTheDrafterContract(DrafterContract):
    """The hookspec's drafter example passes the contract a plugin author runs."""

    factory = staticmethod(_DRAFTER_EXAMPLE["RepeatLast"])
    options = _DRAFTER_EXAMPLE["RepeatOptions"]()
    # The end-to-end replay (16 s on a tiny model) runs for every built-in drafter; the
    # example's invariants are caught by the scenario and random-batch tests.
    test_replays_a_greedy_generation = None

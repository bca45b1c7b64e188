"""Versioned contracts: every kind has a version in the kinds table; a plugin declaring
a compatible version loads, an incompatible one is refused naming plugin, distribution,
version and what changed; one declaring none is version 1, warned once; and a frozen
plugin written against each earlier version runs through the engine in full."""

from __future__ import annotations

import warnings

import attrs
import pytest

import servelab
from servelab import LLM, PluginRegistry, SamplingParams
from servelab.errors import PluginError
from servelab.interfaces import PrefixCachingAllocator, ResettablePrefixCache
from servelab.plugin_types import KINDS, AllocatorPlugin, DrafterPlugin
from servelab.registry import ContractVersionWarning

from legacy_plugins.prefix_cache_v1 import FullBlockCacheV1

pytest_plugins = ["pytester"]


def registry_with(hook_name: str, record) -> PluginRegistry:
    class Plugin:
        pass

    setattr(Plugin, hook_name, staticmethod(servelab.hookimpl(lambda: [record])))
    registry = PluginRegistry.from_entry_points()
    registry.register(Plugin, distribution="third-party")
    return registry


def test_every_kind_has_a_version_and_a_change_for_each_later_version():
    for kind in KINDS.values():
        assert 1 <= kind.oldest_compatible <= kind.version
        assert [v for v, _ in kind.changes] == list(range(2, kind.version + 1)), kind.key


def test_the_current_and_compatible_versions_load():
    for version in (1, 2):
        record = AllocatorPlugin(name="v-ok", factory="a:b", contract_version=version)
        assert registry_with("servelab_register_allocators", record).select("allocators", "v-ok").plugin is record


def test_a_newer_version_is_refused_naming_everything():
    record = DrafterPlugin(name="from-the-future", factory="a:b", contract_version=7)
    with pytest.raises(PluginError, match=r"drafter 'from-the-future' from distribution 'third-party' declares "
                                          r"contract version 7, newer than this servelab's drafter contract "
                                          r"\(version 3\)"):
        registry_with("servelab_register_drafters", record).select("drafters", "from-the-future")


def test_an_incompatible_older_version_is_refused_with_what_changed():
    kinds = dict(KINDS)
    kinds["allocators"] = attrs.evolve(KINDS["allocators"], version=3, oldest_compatible=3, changes=(
        KINDS["allocators"].changes[0], (3, "allocate returns the block table")))
    registry = PluginRegistry(kinds)
    registry.register(type("P", (), {"servelab_register_allocators": staticmethod(servelab.hookimpl(
        lambda: [AllocatorPlugin(name="old", factory="a:b", contract_version=2)]))}), distribution="old-dist")
    with pytest.raises(PluginError) as excinfo:
        registry.select("allocators", "old")
    message = str(excinfo.value)
    assert "allocator 'old' from distribution 'old-dist' declares version 2" in message
    assert "accepts 3-3" in message and "version 3: allocate returns the block table" in message
    assert "version 2:" not in message, "only what changed after the declared version"


def test_no_declared_version_is_version_one_warned_once():
    record = AllocatorPlugin(name="unversioned", factory="a:b")
    registry = registry_with("servelab_register_allocators", record)
    with pytest.warns(ContractVersionWarning, match="allocator 'unversioned' from distribution 'third-party' "
                                                    "declares no contract_version: taken as version 1"):
        registry.select("allocators", "unversioned")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        registry.select("allocators", "unversioned")  # once per process


def test_a_prefix_cache_written_against_version_1_keeps_caching(servelab_tiny_checkpoint):
    assert isinstance(FullBlockCacheV1(None, _context()), PrefixCachingAllocator)
    assert not isinstance(FullBlockCacheV1(None, _context()), ResettablePrefixCache)
    registry = registry_with("servelab_register_allocators",
                             AllocatorPlugin(name="full-block-cache", factory=FullBlockCacheV1))
    with pytest.warns(ContractVersionWarning):
        llm = LLM(servelab_tiny_checkpoint, max_model_len=64, block_size=4, registry=registry,
                  **{"allocator.name": "full-block-cache"})
    prompt = list(range(5, 25))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    first = llm.generate(prompt, params)[0].token_ids
    again = llm.generate(prompt, params)[0].token_ids
    assert llm.engine.allocator.stats().prefix_hit_tokens >= 16, "the second run reuses the cached prompt blocks"
    reference = LLM(servelab_tiny_checkpoint, max_model_len=64, block_size=4).generate(prompt, params)[0].token_ids
    assert first == again == reference


def _context():
    from servelab.interfaces import AllocatorContext

    return AllocatorContext(num_blocks=8, block_size=4, max_model_len=32)


# ---------------------------------------------------------------- contract tests by version

SESSION_ROUTERS = '''
from servelab.testing import RouterContract


class FirstReplica:
    """Correct for router contract version 1; chokes on version 2's RouteRequest.session."""

    def __init__(self, options, context):
        pass

    def route(self, request, replicas):
        if request.session is not None:
            raise KeyError(request.session)
        return replicas[0].replica_id


class TestAsVersion1(RouterContract):
    factory = FirstReplica
    contract_version = 1


class TestAsVersion2(RouterContract):
    factory = FirstReplica
    contract_version = 2


class TestUndeclaredFactory(RouterContract):
    factory = FirstReplica
'''


def test_a_contract_checks_the_version_the_policy_declares_and_names_it(pytester):
    pytester.makepyfile(test_versioned_routers=SESSION_ROUTERS)
    result = pytester.runpytest("-p", "no:cacheprovider", "-rfs", "-k", "session or implements")
    outcomes = result.parseoutcomes()
    assert (outcomes.get("passed"), outcomes.get("failed"), outcomes.get("skipped")) == (3, 2, 1), result.stdout.str()
    result.stdout.fnmatch_lines(["SKIPPED*router.py*a rule of router contract "
                                 "version 2; the policy is checked against version 1 (contract_version = 1 on "
                                 "TestAsVersion1)*"])
    text = result.stdout.str()
    assert "FAILED test_versioned_routers.py::TestAsVersion2::test_requests_carrying_a_session" in text
    assert "FAILED test_versioned_routers.py::TestUndeclaredFactory::test_requests_carrying_a_session" in text
    assert "(router contract version 2: contract_version = 2 on TestAsVersion2)" in text
    assert "(router contract version 2: the current version: no installed record names this factory)" in text


def test_a_record_declares_the_version_its_factory_is_checked_against():
    from servelab.testing.contract import declared_version
    from servelab.testing import AllocatorContract, RouterContract

    class ByBuiltinName(AllocatorContract):
        plugin_name = "paged"

    class ByUnknownFactory(AllocatorContract):
        factory = FullBlockCacheV1

    class Stated(RouterContract):
        contract_version = 1

    assert declared_version(ByBuiltinName, "allocators", None) == (
        2, "allocator 'paged' from distribution 'servelab', which moves with its contract")
    assert declared_version(ByUnknownFactory, "allocators", FullBlockCacheV1)[0] == KINDS["allocators"].version
    assert declared_version(Stated, "routers", None) == (1, "contract_version = 1 on Stated")


def test_the_frozen_version_1_prefix_cache_passes_its_own_suite(pytester):
    """Its suite as written (tests/legacy_plugins, which the whole suite also runs in full):
    every version-1 rule passes, and the reset rule is skipped as a capability it lacks."""
    from pathlib import Path

    suite = Path(__file__).parent / "legacy_plugins" / "test_prefix_cache_v1_suite.py"
    result = pytester.runpytest("-p", "no:cacheprovider", "-rs", "-k", "not greedy", str(suite))
    outcomes = result.parseoutcomes()
    assert (outcomes.get("failed"), outcomes.get("passed"), outcomes.get("skipped")) == (None, 7, 4), \
        result.stdout.str()
    result.stdout.fnmatch_lines(["SKIPPED*a rule of the optional capability "
                                 "ResettablePrefixCache, which FullBlockCacheV1 does not implement*"])

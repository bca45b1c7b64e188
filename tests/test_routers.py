"""The router policy kind: the built-in routers pass RouterContract and route as their
descriptions say; routers are found, configured and listed like every other kind."""

from __future__ import annotations

import pytest

from servelab import EngineConfig, PluginRegistry
from servelab.errors import ConfigError, PluginError
from servelab.interfaces import PrefixSummary, ReplicaSnapshot, RouteRequest, RouterContext, prefix_block_hashes
from servelab.plugins.routers.prefix_affinity import PrefixAffinityOptions, PrefixAffinityRouter
from servelab.routing import build_router
from servelab.testing import RouterContract, objectives


class TestRoundRobin(RouterContract):
    plugin_name = "round-robin"


class TestLeastLoaded(RouterContract):
    plugin_name = "least-loaded"


class TestPrefixAffinity(RouterContract):
    plugin_name = "prefix-affinity"
    objectives = (objectives.longest_cached_prefix_wins(),)


class TestPrefixAffinityNoMargin(RouterContract):
    factory = PrefixAffinityRouter
    options = PrefixAffinityOptions(load_margin_tokens=0, max_tracked_blocks=3)


def _router(name: str, num_replicas: int = 3, **options):
    config = EngineConfig.from_dict({"router": {"name": name, **options}})
    return build_router(config, PluginRegistry.from_entry_points(),
                        RouterContext(num_replicas=num_replicas, block_size=4, num_kv_blocks=64))


def _snap(replica_id: int, queued: int = 0, running: int = 0, summary: PrefixSummary | None = None):
    return ReplicaSnapshot(replica_id=replica_id, num_queued_tokens=queued, num_running_tokens=running,
                           block_size=4, prefix_summary=summary)


def _request(prompt, request_id="r"):
    return RouteRequest(request_id, list(prompt))


def test_round_robin_cycles_over_live_replicas_in_id_order():
    router = _router("round-robin")
    fleet = [_snap(0), _snap(1), _snap(2)]
    assert [router.route(_request([1]), fleet) for _ in range(4)] == [0, 1, 2, 0]
    without_1 = [_snap(2), _snap(0)]
    assert [router.route(_request([1]), without_1) for _ in range(3)] == [2, 0, 2]


def test_least_loaded_counts_queued_and_running_tokens():
    router = _router("least-loaded")
    # replica 0 runs little but queues a long prompt; replica 1 runs more in total
    assert router.route(_request([1]), [_snap(0, queued=900, running=100), _snap(1, running=600)]) == 1
    assert router.route(_request([1]), [_snap(0, running=10), _snap(1, running=600)]) == 0


def test_prefix_affinity_follows_the_cache_within_the_load_margin():
    prompt = list(range(40))
    cached = PrefixSummary(4, prefix_block_hashes(prompt[:32], 4))
    router = _router("prefix-affinity", load_margin_tokens=500)
    # replica 1 holds 32 tokens of the prompt and is 400 tokens busier: within the margin
    assert router.route(_request(prompt), [_snap(0, running=100), _snap(1, running=500, summary=cached)]) == 1
    # 600 tokens busier: past the margin, the least-loaded replica gets it
    assert router.route(_request(prompt), [_snap(0, running=100), _snap(1, running=700, summary=cached)]) == 0


def test_prefix_affinity_remembers_where_it_sent_a_prefix():
    router = _router("prefix-affinity", load_margin_tokens=1000)
    system = list(range(100, 132))
    first = router.route(_request(system + [1, 2, 3], "a"), [_snap(0), _snap(1), _snap(2)])
    # the others are now lighter, but the prefix is cached where the first went
    fleet = [_snap(i, running=0 if i != first else 300) for i in range(3)]
    assert router.route(_request(system + [7, 8, 9], "b"), fleet) == first
    # an unrelated prompt goes by load
    assert router.route(_request(list(range(500, 540)), "c"), fleet) != first
    # when that replica leaves and rejoins, its (cold) cache is forgotten
    router.route(_request([1], "d"), [_snap(i) for i in range(3) if i != first])
    assert router.route(_request(system + [4], "e"), [_snap(i, running=50 * (i == first)) for i in range(3)]) != first


def test_prefix_affinity_matches_blocks_cached_under_the_request_s_adapter_only():
    prompt = list(range(40))
    under_adapter = PrefixSummary(4, prefix_block_hashes(prompt, 4, lora_id=3))
    router = _router("prefix-affinity", load_margin_tokens=500)
    fleet = [_snap(0, running=100), _snap(1, running=300, summary=under_adapter)]
    assert router.route(RouteRequest("a", prompt, adapter="sql", lora_id=3), fleet) == 1
    # the base model's request, or another adapter's, finds none of those blocks: by load
    assert router.route(RouteRequest("b", prompt), fleet) == 0
    assert router.route(RouteRequest("c", prompt, adapter="chat", lora_id=4), fleet) == 0
    # the router's own view (no summaries) keeps an adapter's prompts apart too
    remembering = _router("prefix-affinity", load_margin_tokens=500)
    first = remembering.route(RouteRequest("d", prompt, adapter="sql", lora_id=3), [_snap(0), _snap(1)])
    busier = [_snap(i, running=200 if i == first else 0) for i in range(2)]
    assert remembering.route(RouteRequest("e", prompt, adapter="sql", lora_id=3), busier) == first
    assert remembering.route(RouteRequest("f", prompt), busier) != first


def test_prefix_summary_counts_whole_cached_blocks_of_the_prefix():
    prompt = list(range(20))
    summary = PrefixSummary(4, prefix_block_hashes(prompt[:13], 4))  # 3 full blocks
    assert summary.cached_tokens(prompt) == 12
    assert summary.cached_tokens([99] + prompt[1:]) == 0  # the chain breaks at the first block
    assert summary.cached_tokens(prompt[:3]) == 0


def test_router_options_are_checked_with_the_key_named():
    with pytest.raises(ConfigError, match="load_margin"):
        _router("prefix-affinity", load_margin=3)
    with pytest.raises(ConfigError, match="load_margin_tokens must be a int"):
        _router("prefix-affinity", load_margin_tokens="many")
    with pytest.raises(PluginError, match="unknown router 'nearest'.*round-robin"):
        _router("nearest")


def test_config_router_section_round_trips_and_overrides():
    config = EngineConfig.from_dict({"router": {"name": "prefix-affinity", "load_margin_tokens": 64}})
    assert config.router.name == "prefix-affinity"
    assert EngineConfig.from_dict(config.to_dict()) == config
    assert EngineConfig().with_set_options(["router.name=least-loaded"]).router.name == "least-loaded"
    assert EngineConfig().router is None


def test_routers_are_listed_with_the_other_kinds():
    listing = PluginRegistry.from_entry_points().describe()
    assert {p["name"] for p in listing["routers"]} >= {"round-robin", "least-loaded", "prefix-affinity"}


class TestAdapterAffinity(RouterContract):
    plugin_name = "adapter-affinity"

"""Plugin discovery (entry points, runtime registration) and selection by name.

Every test builds its own PluginRegistry: nothing here touches a global one.
"""

from __future__ import annotations

import importlib
import sys
import textwrap
import types
import warnings

import pluggy
import pytest

import servelab
from servelab import AllocatorPlugin, LLM, PluginError, PluginRegistry, SamplingParams, SchedulerPlugin
from servelab.interfaces import AllocatorContext
from servelab.plugin_types import NoOptions
from servelab.registry import build_policy


def policy_plugin(hook: str, *records):
    """A runtime plugin object whose `hook` returns `records`."""

    class Plugin:
        pass

    def register(self):
        return list(records)

    setattr(Plugin, hook, servelab.hookimpl(register))
    return Plugin()


# ---------------------------------------------------------------- entry points


def test_builtins_are_discovered_through_entry_points():
    registry = PluginRegistry.from_entry_points()
    expected = {"allocators": "paged", "schedulers": "continuous", "attention": "torch-paged",
                "routers": "prefix-affinity"}
    for kind, name in expected.items():
        found = registry.policies(kind)
        assert name in found, (kind, sorted(found))
        assert found[name].distribution == "servelab"
        assert found[name].kind == kind
    listing = registry.describe()
    assert set(listing) == {"allocators", "schedulers", "drafters", "attention", "routers", "logits_processors",
                            "evictors", "victims", "kv_transfers", "adapter_residency"}
    paged = next(entry for entry in listing["allocators"] if entry["name"] == "paged")
    assert paged["distribution"] == "servelab" and paged["description"]


@pytest.fixture
def fake_dist(tmp_path, monkeypatch):
    """make(dist, module, source): install a fake distribution whose `servelab.plugins`
    entry point is `module`, by putting a dist-info folder on sys.path."""
    created: list[str] = []

    def make(dist: str, module: str, source: str) -> None:
        info = tmp_path / f"{dist}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
        (info / "entry_points.txt").write_text(f"[servelab.plugins]\n{module}-ep = {module}\n")
        (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
        created.append(module)
        importlib.invalidate_caches()

    monkeypatch.syspath_prepend(str(tmp_path))
    yield make
    for module in created:
        sys.modules.pop(module, None)
    importlib.invalidate_caches()


GOOD_PLUGIN = """
    import servelab
    from servelab.plugin_types import SchedulerPlugin

    @servelab.hookimpl
    def servelab_register_schedulers():
        return [SchedulerPlugin(name="fake-sjf", factory="nowhere:Nothing", description="from a fake dist")]
"""


def test_entry_point_of_a_third_party_distribution_is_discovered(fake_dist):
    fake_dist("fakepkg", "fakepkg_servelab_plugin", GOOD_PLUGIN)
    registry = PluginRegistry.from_entry_points()
    policy = registry.select("schedulers", "fake-sjf")
    assert policy.distribution == "fakepkg"
    assert policy.plugin.description == "from a fake dist"
    assert registry.select("schedulers", "continuous").distribution == "servelab"
    assert {"name": "fake-sjf", "qualified_name": "fakepkg:fake-sjf", "distribution": "fakepkg",
            "description": "from a fake dist"} in registry.describe()["schedulers"]


def test_broken_entry_point_warns_and_is_skipped(fake_dist):
    fake_dist("brokenpkg", "brokenpkg_servelab_plugin", "raise ImportError('needs libfoo.so')\n")
    fake_dist("fakepkg", "fakepkg_servelab_plugin", GOOD_PLUGIN)
    with pytest.warns(RuntimeWarning) as record:
        registry = PluginRegistry.from_entry_points()
    messages = [str(w.message) for w in record if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1, messages
    assert "brokenpkg_servelab_plugin-ep" in messages[0]
    assert "brokenpkg" in messages[0] and "libfoo.so" in messages[0]
    # The rest of the registry is intact.
    assert registry.select("schedulers", "fake-sjf").distribution == "fakepkg"
    assert registry.select("allocators", "paged").distribution == "servelab"


def test_entry_point_with_misspelt_hook_warns_and_leaves_registry_usable(fake_dist):
    fake_dist("typopkg", "typopkg_servelab_plugin", """
        import servelab

        @servelab.hookimpl
        def servelab_register_allocator():  # missing the final 's'
            return []
    """)
    with pytest.warns(RuntimeWarning, match="typopkg"):
        registry = PluginRegistry.from_entry_points()
    # A skipped plugin must not poison later registrations.
    registry.register(policy_plugin("servelab_register_allocators",
                                    AllocatorPlugin(name="later", factory="nowhere:Nothing")))
    assert registry.select("allocators", "later").distribution == "<runtime>"


# ---------------------------------------------------------------- runtime registration


def test_runtime_plugin_is_selectable():
    registry = PluginRegistry.from_entry_points()
    record = SchedulerPlugin(name="mine", factory="nowhere:Nothing", description="a test scheduler")
    registry.register(policy_plugin("servelab_register_schedulers", record), distribution="my-dist")
    selected = registry.select("schedulers", "mine")
    assert selected.plugin is record
    assert selected.distribution == "my-dist"
    assert registry.select("schedulers", "continuous").distribution == "servelab"


def test_runtime_plugin_module_is_selectable():
    module = types.ModuleType("runtime_plugin_module")
    exec(textwrap.dedent(GOOD_PLUGIN), module.__dict__)
    registry = PluginRegistry.from_entry_points()
    registry.register(module)
    assert registry.select("schedulers", "fake-sjf").distribution == "<runtime>"


def test_registration_is_per_registry():
    first = PluginRegistry.from_entry_points()
    first.register(policy_plugin("servelab_register_allocators", AllocatorPlugin(name="only-here", factory="x:y")))
    second = PluginRegistry.from_entry_points()
    assert "only-here" in first.policies("allocators")
    assert "only-here" not in second.policies("allocators")


def test_misspelt_hook_name_raises_at_register_time():
    registry = PluginRegistry.from_entry_points()
    with pytest.raises(pluggy.PluginValidationError, match="servelab_register_scheduler"):
        registry.register(policy_plugin("servelab_register_scheduler", SchedulerPlugin(name="x", factory="a:b")))


def test_failed_registration_leaves_registry_usable():
    registry = PluginRegistry.from_entry_points()
    with pytest.raises(pluggy.PluginValidationError):
        registry.register(policy_plugin("servelab_register_scheduler", SchedulerPlugin(name="x", factory="a:b")))
    registry.register(policy_plugin("servelab_register_schedulers", SchedulerPlugin(name="y", factory="a:b")))
    assert "y" in registry.policies("schedulers")
    assert "x" not in registry.policies("schedulers")


# ---------------------------------------------------------------- selection errors


def test_two_third_party_plugins_sharing_a_bare_name_refuse_it_naming_the_qualified_names():
    registry = PluginRegistry()
    registry.register(policy_plugin("servelab_register_allocators", AllocatorPlugin(name="dup", factory="a:b"),
                                    AllocatorPlugin(name="mine", factory="a:c")), distribution="dist-one")
    registry.register(policy_plugin("servelab_register_allocators", AllocatorPlugin(name="dup", factory="c:d")),
                      distribution="dist_Two")
    with pytest.raises(PluginError) as excinfo:
        registry.select("allocators", "dup")
    assert str(excinfo.value) == ("two plugins register the allocator 'dup': distribution 'dist-one' ('dist-one:dup') "
                                  "and distribution 'dist_Two' ('dist-two:dup'); select one by its qualified name")
    assert "uninstall" not in str(excinfo.value)
    assert registry.select("allocators", "dist-one:dup").plugin.factory == "a:b"
    assert registry.select("allocators", "Dist.Two:dup").plugin.factory == "c:d"  # normalised as pip does
    assert registry.select("allocators", "mine").distribution == "dist-one"  # the rest is untouched
    assert "dup" not in registry.policies("allocators")


def test_a_builtin_added_later_does_not_take_a_third_party_name():
    """A package registers a name servelab later ships as a built-in: the package keeps
    it, with one warning naming both and the qualified names; the built-in stays reachable."""
    registry = PluginRegistry.from_entry_points()
    registry.register(policy_plugin("servelab_register_allocators", AllocatorPlugin(name="paged", factory="a:b")),
                      distribution="research")
    with pytest.warns(servelab.registry.PluginNameClashWarning) as caught:
        assert registry.select("allocators", "paged").distribution == "research"
    assert str(caught[0].message) == (
        "two plugins register the allocator 'paged': distribution 'servelab' ('servelab:paged') and distribution "
        "'research' ('research:paged'); 'paged' selects 'research:paged' (a third-party policy over servelab's "
        "built-in); select the other by its qualified name")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        registry.select("allocators", "paged")  # one warning per process
        assert registry.select("allocators", "servelab:paged").distribution == "servelab"
        assert registry.select("schedulers", "continuous").distribution == "servelab"
    clash, = registry.clashes("allocators")
    assert (clash.name, clash.chosen.distribution) == ("paged", "research")
    entries = [e for e in registry.describe()["allocators"] if e["name"] == "paged"]
    assert [e["qualified_name"] for e in entries] == ["research:paged", "servelab:paged"]
    assert all(e["clash"] == str(caught[0].message) for e in entries)


def test_unknown_name_lists_installed_names_and_distributions():
    registry = PluginRegistry.from_entry_points()
    registry.register(policy_plugin("servelab_register_allocators", AllocatorPlugin(name="other", factory="a:b")),
                      distribution="other-dist")
    with pytest.raises(PluginError) as excinfo:
        registry.select("allocators", "nope")
    message = str(excinfo.value)
    assert "'nope'" in message
    assert "paged (servelab)" in message and "other (other-dist)" in message


def test_empty_registry_says_to_install_a_package():
    with pytest.raises(PluginError, match="install"):
        PluginRegistry().select("schedulers", "continuous")
    with pytest.raises(PluginError, match="kind"):
        PluginRegistry().policies("allocator")  # singular: not a kind


def test_invalid_record_name_is_rejected():
    for bad in ("Bad Name", "", "-leading-dash", "UPPER"):
        with pytest.raises(PluginError, match="invalid"):
            AllocatorPlugin(name=bad, factory="a:b")
    AllocatorPlugin(name="ok-name_1.2", factory="a:b")  # control: valid names pass


def test_hook_returning_something_else_than_records_is_an_error():
    registry = PluginRegistry()
    registry.register(policy_plugin("servelab_register_allocators", {"name": "dict"}), distribution="sloppy")
    with pytest.raises(PluginError, match="sloppy"):
        registry.policies("allocators")


@pytest.mark.parametrize("factory", ["servelab_no_such_module_xyz:Thing", "servelab.plugin_types:NoSuchClass"])
def test_factory_that_fails_to_load_names_plugin_and_distribution(factory):
    registry = PluginRegistry()
    registry.register(policy_plugin("servelab_register_allocators", AllocatorPlugin(name="ghost", factory=factory)),
                      distribution="ghost-dist")
    selected = registry.select("allocators", "ghost")  # selecting does not import the factory
    with pytest.raises(PluginError) as excinfo:
        build_policy(selected, NoOptions(), AllocatorContext(num_blocks=4, block_size=4, max_model_len=16))
    message = str(excinfo.value)
    assert "'ghost'" in message and "ghost-dist" in message


def test_build_policy_calls_the_factory_with_options_and_context():
    registry = PluginRegistry.from_entry_points()
    context = AllocatorContext(num_blocks=8, block_size=4, max_model_len=32)
    allocator = build_policy(registry.select("allocators", "paged"), NoOptions(), context)
    assert allocator.allocate("s", 9)
    assert allocator.stats().num_blocks == 8 and allocator.stats().num_used_blocks == 3


# ---------------------------------------------------------------- observer hooks


class Observer:
    def __init__(self):
        self.started = []
        self.reports = []
        self.finished = []

    @servelab.hookimpl
    def servelab_engine_started(self, engine):
        self.started.append(engine)

    @servelab.hookimpl
    def servelab_step_finished(self, engine, report):
        self.reports.append(report)

    @servelab.hookimpl
    def servelab_request_finished(self, engine, output):
        self.finished.append(output.request_id)


def test_observer_hooks_see_engine_steps_and_requests(llama_checkpoint):
    observer = Observer()
    registry = PluginRegistry.from_entry_points()
    registry.register(observer)
    llm = LLM(llama_checkpoint, registry=registry, max_model_len=64)
    assert observer.started == [llm.engine]
    outputs = llm.generate([[5, 6, 7], [8, 9, 10, 11]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))

    assert sorted(observer.finished) == sorted(o.request_id for o in outputs)
    assert len(set(observer.finished)) == 2
    reports = observer.reports
    assert [r.step_index for r in reports] == list(range(1, len(reports) + 1))
    assert len(reports) == 4  # one prefill step, then three decode steps
    assert reports[0].num_scheduled_tokens == 7 and reports[0].num_seqs == 2
    assert all(r.num_scheduled_tokens == 2 for r in reports[1:])
    assert sum(r.num_finished for r in reports) == 2
    for report in reports:
        assert report.allocator_stats.num_blocks == llm.engine.limits.num_kv_blocks > 0
        assert report.forward_seconds >= 0 and report.schedule_seconds >= 0
    assert reports[0].allocator_stats.num_used_blocks == 2  # each prompt fits one block
    assert reports[-1].allocator_stats.num_used_blocks == 0  # both retired in the last step
    assert observer.started == [llm.engine]  # generate does not restart the engine


def test_a_folder_named_servelab_ahead_of_the_package_is_named_not_skipped_plugins(tmp_path):
    """Python started beside a folder named `servelab` (a clone of this repository, say)
    imports that folder as an empty namespace package: the registry says so, naming the
    folder, instead of skipping every plugin for a missing `hookimpl`."""
    import subprocess

    (tmp_path / "servelab").mkdir()
    result = subprocess.run([sys.executable, "-c", "from servelab.registry import PluginRegistry\n"
                             "PluginRegistry.from_entry_points()"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode != 0
    assert f"found the folder {tmp_path / 'servelab'}" in result.stderr
    assert "rename that folder" in result.stderr and "hookimpl" not in result.stderr


@pytest.mark.parametrize("module", ["servelab.plugins.kernels.cpu_build", "servelab.plugins.schedulers"])
def test_a_clone_named_servelab_is_named_when_a_plugin_module_runs_beside_it(tmp_path, module):
    """`python -m servelab.plugins...` (the kernels' build step) beside a clone named
    `servelab` runs the clone's `plugins` package under the empty namespace package: it
    names the folder instead of failing on a missing `servelab.hookimpl`."""
    import shutil
    import subprocess

    clone = tmp_path / "servelab"
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    shutil.copytree(root / "plugins", clone / "plugins", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    result = subprocess.run([sys.executable, "-m", module], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert f"found the folder {clone}" in result.stderr
    assert "rename that folder" in result.stderr and "has no attribute 'hookimpl'" not in result.stderr

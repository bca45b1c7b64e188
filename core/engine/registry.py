"""Plugin discovery and selection on top of pluggy.

Built-in and third-party plugins arrive the same way: modules named under the
`servelab.plugins` entry-point group. A test or notebook can also register a plugin
object at run time. Each registry is independent; nothing here is global.
"""

from __future__ import annotations

import sys
import warnings
from importlib import metadata
from typing import Any, Iterable, Mapping

import attrs
import pluggy

from servelab import hookspecs
from servelab.errors import PluginError, ServelabError
from servelab.plugin_types import POLICY_KINDS  # noqa: F401 (importable from here, as before)
from servelab.plugin_types import KINDS, PolicyKind, PolicyPlugin

ENTRY_POINT_GROUP = "servelab.plugins"
RUNTIME_DISTRIBUTION = "<runtime>"
BUILTIN_DISTRIBUTION = "servelab"  # its policies move with its contracts: always the current version
_warned_unversioned: set[tuple[str, str, str]] = set()


class ContractVersionWarning(UserWarning):
    """A plugin declares no contract version: it is taken as the first."""


def check_contract_version(registered: "RegisteredPolicy", kind: PolicyKind) -> None:
    """Refuse a policy written against a contract version this servelab does not accept,
    naming plugin, distribution, declared version and what changed; one that declares
    none is taken as version 1, with a warning (once per process)."""
    declared = registered.plugin.contract_version
    where = f"{kind.noun} {registered.name!r} from distribution {registered.distribution!r}"
    if declared is None:
        if registered.distribution == BUILTIN_DISTRIBUTION or kind.version == 1:
            return  # the built-ins move with their contracts; version 1 is all there has been
        key = (kind.key, registered.name, registered.distribution)
        if key not in _warned_unversioned:
            _warned_unversioned.add(key)
            warnings.warn(f"{where} declares no contract_version: taken as version 1 of the {kind.noun} contract "
                          f"(this servelab's is version {kind.version}; changes since 1: {kind.changes_since(1)}); "
                          f"declare contract_version={kind.version} in its {kind.record_name} once it follows it",
                          ContractVersionWarning, stacklevel=3)
        declared = 1
    if declared > kind.version:
        raise PluginError(f"{where} declares contract version {declared}, newer than this servelab's {kind.noun} "
                          f"contract (version {kind.version}); upgrade servelab")
    if declared < kind.oldest_compatible:
        raise PluginError(f"{where} declares version {declared} of the {kind.noun} contract, which this servelab "
                          f"no longer accepts (it implements version {kind.version}, accepts "
                          f"{kind.oldest_compatible}-{kind.version}); what changed: {kind.changes_since(declared)}")


@attrs.frozen
class RegisteredPolicy:
    """A policy record together with the distribution that provided it."""

    kind: str  # the kind's key ("allocators")
    plugin: PolicyPlugin
    distribution: str
    noun: str = attrs.field(default=attrs.Factory(lambda self: KINDS[self.kind].noun, takes_self=True))

    @property
    def name(self) -> str:
        return self.plugin.name


class PluginRegistry:
    """A pluggy manager plus the catalogue of policies its plugins register."""

    def __init__(self, kinds: Mapping[str, PolicyKind] = KINDS, specs: Iterable[Any] = (hookspecs,)) -> None:
        """`kinds`: the policy kinds (a test may pass a copy of the table with a kind of its
        own, and `specs` holding that kind's hookspec); each needs its registration hook."""
        self.kinds = dict(kinds)
        self.manager = pluggy.PluginManager(hookspecs.PROJECT)
        for spec in specs:
            self.manager.add_hookspecs(spec)
        missing = [kind.hook_name for kind in self.kinds.values() if not hasattr(self.manager.hook, kind.hook_name)]
        if missing:
            raise PluginError(f"policy kinds without a registration hookspec: {', '.join(missing)} "
                              f"(add it to servelab.hookspecs)")
        self._distribution_of: dict[int, str] = {}
        self._catalogue: dict[str, dict[str, RegisteredPolicy]] | None = None
        self._implemented: dict[str, bool] = {}  # hook name -> has an implementation, until the next register

    @classmethod
    def from_entry_points(cls, group: str = ENTRY_POINT_GROUP) -> "PluginRegistry":
        """A registry holding every installed plugin of `group`."""
        registry = cls()
        registry.load_entry_points(group)
        return registry

    @property
    def hook(self) -> Any:
        return self.manager.hook

    def register(self, plugin: Any, distribution: str = RUNTIME_DISTRIBUTION, name: str | None = None) -> None:
        """Register a plugin object (module, class or instance with hookimpls)."""
        self.manager.register(plugin, name=name)
        try:
            self.manager.check_pending()  # a hookimpl with no spec (a misspelt hook) is an error
        except Exception:
            self.manager.unregister(plugin)
            raise
        self._distribution_of[id(plugin)] = distribution
        self._catalogue = None
        self._implemented = {}

    def implemented(self, hook_name: str) -> bool:
        """Whether a registered plugin implements the hook `hook_name` (the engine skips
        observer calls nobody listens to)."""
        known = self._implemented
        if hook_name not in known:
            known[hook_name] = bool(getattr(self.manager.hook, hook_name).get_hookimpls())
        return known[hook_name]

    def load_entry_points(self, group: str = ENTRY_POINT_GROUP) -> None:
        """Import and register every entry point of `group`; a broken one warns and is skipped."""
        refuse_shadowed_package()
        for entry_point in metadata.entry_points(group=group):
            distribution = entry_point.dist.name if entry_point.dist else "<unknown>"
            if self.manager.get_plugin(_plugin_name(distribution, entry_point.name)) is not None:
                continue
            try:
                plugin = entry_point.load()
                self.register(plugin, distribution, name=_plugin_name(distribution, entry_point.name))
            except Exception as exc:  # a merely installed broken plugin must not break servelab
                warnings.warn(
                    f"skipping servelab plugin {entry_point.name!r} ({entry_point.value}) "
                    f"from distribution {distribution!r}: {type(exc).__name__}: {exc}",
                    RuntimeWarning,
                    stacklevel=2,
                )

    # ------------------------------------------------------------ catalogue

    def policies(self, kind: str) -> dict[str, RegisteredPolicy]:
        """All policies of `kind` by name; two providers of one name is an error."""
        if kind not in self.kinds:
            raise PluginError(f"unknown policy kind {kind!r}; kinds are {', '.join(self.kinds)}")
        if self._catalogue is None:
            self._catalogue = {k: self._collect(k) for k in self.kinds}
        return self._catalogue[kind]

    def select(self, kind: str, name: str) -> RegisteredPolicy:
        """The policy called `name`, or an error listing what is installed."""
        available = self.policies(kind)
        if name in available:
            check_contract_version(available[name], self.kinds[kind])
            return available[name]
        if available:
            listing = ", ".join(f"{p.name} ({p.distribution})" for p in available.values())
            hint = f"installed: {listing}"
        else:
            hint = "none is installed (install the servelab package, or a plugin package that provides one)"
        raise PluginError(f"unknown {self.kinds[kind].noun} {name!r}; {hint}")

    def _collect(self, kind: str) -> dict[str, RegisteredPolicy]:
        found: dict[str, RegisteredPolicy] = {}
        policy_kind = self.kinds[kind]
        hook_caller = getattr(self.manager.hook, policy_kind.hook_name)
        for impl in hook_caller.get_hookimpls():
            distribution = self._distribution_of.get(id(impl.plugin), RUNTIME_DISTRIBUTION)
            for record in impl.function() or ():
                if not isinstance(record, PolicyPlugin):
                    raise PluginError(
                        f"{impl.plugin_name} ({distribution}) returned {record!r} from "
                        f"{policy_kind.hook_name}; expected PolicyPlugin records"
                    )
                if record.name in found:
                    other = found[record.name].distribution
                    raise PluginError(
                        f"two plugins register the {policy_kind.noun} {record.name!r}: "
                        f"distribution {other!r} and distribution {distribution!r}; uninstall one"
                    )
                found[record.name] = RegisteredPolicy(kind, record, distribution, policy_kind.noun)
        return found

    def describe(self) -> dict[str, list[dict[str, str]]]:
        """Every policy by kind: name, distribution, description (for `servelab plugins`)."""
        return {
            kind: [
                {"name": p.name, "distribution": p.distribution, "description": p.plugin.description}
                for p in sorted(self.policies(kind).values(), key=lambda p: p.name)
            ]
            for kind in self.kinds
        }


def _plugin_name(distribution: str, entry_point_name: str) -> str:
    return f"{distribution}:{entry_point_name}"


def build_policy(registered: RegisteredPolicy, options: Any, context: Any) -> Any:
    """Instantiate a selected policy; a failure names the plugin and its distribution."""
    try:
        factory = registered.plugin.load_factory()
        return factory(options, context)
    except ServelabError:
        raise
    except Exception as exc:
        raise PluginError(
            f"{registered.noun} {registered.name!r} from distribution "
            f"{registered.distribution!r} failed to load: {type(exc).__name__}: {exc}"
        ) from exc


def refuse_shadowed_package() -> None:
    """A folder named `servelab` in the directory Python starts from (or anywhere on
    sys.path before the installed package) is imported as an empty namespace package in
    its place: servelab's submodules still resolve, but its `__init__` never runs, so
    every plugin would be skipped with a misleading "no attribute 'hookimpl'". Say what
    happened instead."""
    package = sys.modules.get("servelab")
    spec = package.__spec__ if package is not None else None
    if spec is not None and spec.origin is None:  # a namespace package: no __init__.py ran
        folders = ", ".join(map(str, spec.submodule_search_locations or ()))
        raise PluginError(f"'import servelab' found the folder {folders} (a folder named servelab with no "
                          f"__init__.py, on sys.path ahead of the installed package), not servelab itself: run "
                          f"Python from another directory, or rename that folder")

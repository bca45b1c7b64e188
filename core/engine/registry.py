"""Plugin discovery and selection on top of pluggy.

Built-in and third-party plugins arrive the same way: modules named under the
`servelab.plugins` entry-point group. A test or notebook can also register a plugin
object at run time. Each registry is independent; nothing here is global.

Names survive upgrades: every policy is also addressable by its qualified name,
`distribution:name` (the distribution normalised as pip does: "Servelab_Research" and
"servelab-research" are one). Two providers of one bare name never break anything else;
selecting that bare name picks the third-party policy over servelab's own built-in, with
one warning naming both and their qualified names (a built-in added later must not take
a name a package already uses), and is refused, naming the qualified names, when two
third-party packages share it.
"""

from __future__ import annotations

import re
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


class PluginNameClashWarning(UserWarning):
    """A bare policy name two distributions register was selected: the third-party one won."""


_warned_clashes: set[tuple[str, str, str]] = set()


def normalized_distribution(name: str) -> str:
    """A distribution's name as pip compares them (PEP 503): lower case, runs of -_. as one -."""
    return re.sub(r"[-_.]+", "-", name).lower()


def qualified_name(distribution: str, name: str) -> str:
    """The name that selects one provider's policy whatever else is installed."""
    return f"{normalized_distribution(distribution)}:{name}"


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

    @property
    def qualified_name(self) -> str:
        return qualified_name(self.distribution, self.plugin.name)


@attrs.frozen
class NameClash:
    """One bare name that several providers register, and which of them the bare name selects."""

    kind: str
    name: str
    providers: tuple[RegisteredPolicy, ...]
    chosen: RegisteredPolicy | None  # None: two third-party providers; the bare name is refused

    def describe(self) -> str:
        providers = " and ".join(f"distribution {p.distribution!r} ({p.qualified_name!r})" for p in self.providers)
        noun = self.providers[0].noun
        if self.chosen is None:
            return (f"two plugins register the {noun} {self.name!r}: {providers}; select one by its qualified "
                    f"name")
        return (f"two plugins register the {noun} {self.name!r}: {providers}; {self.name!r} selects "
                f"{self.chosen.qualified_name!r} (a third-party policy over servelab's built-in); select the "
                f"other by its qualified name")


@attrs.frozen
class Catalogue:
    """One kind's policies: by bare name (clashes resolved), by qualified name, and the clashes."""

    by_name: dict[str, RegisteredPolicy]
    by_qualified_name: dict[str, RegisteredPolicy]
    clashes: dict[str, NameClash]


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
        self._catalogue: dict[str, Catalogue] | None = None
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

    def catalogue(self, kind: str) -> Catalogue:
        if kind not in self.kinds:
            raise PluginError(f"unknown policy kind {kind!r}; kinds are {', '.join(self.kinds)}")
        if self._catalogue is None:
            self._catalogue = {k: self._collect(k) for k in self.kinds}
        return self._catalogue[kind]

    def policies(self, kind: str) -> dict[str, RegisteredPolicy]:
        """The policies of `kind` by bare name, each clash resolved as `select` resolves it
        (a name two third-party packages share is left out: only its qualified names select it)."""
        return self.catalogue(kind).by_name

    def clashes(self, kind: str) -> list[NameClash]:
        return list(self.catalogue(kind).clashes.values())

    def select(self, kind: str, name: str) -> RegisteredPolicy:
        """The policy called `name` (bare, or qualified `distribution:name`), or an error
        listing what is installed."""
        catalogue = self.catalogue(kind)
        if ":" in name:
            distribution, _, bare = name.partition(":")
            found = catalogue.by_qualified_name.get(qualified_name(distribution, bare))
        else:
            found = catalogue.by_name.get(name)
            clash = catalogue.clashes.get(name)
            if clash is not None and clash.chosen is None:
                raise PluginError(clash.describe())
            if clash is not None and (kind, name, found.distribution) not in _warned_clashes:
                _warned_clashes.add((kind, name, found.distribution))
                warnings.warn(clash.describe(), PluginNameClashWarning, stacklevel=2)
        if found is not None:
            check_contract_version(found, self.kinds[kind])
            return found
        if catalogue.by_qualified_name:
            listing = ", ".join(f"{p.name} ({p.distribution})" for p in catalogue.by_qualified_name.values())
            hint = f"installed: {listing}"
        else:
            hint = "none is installed (install the servelab package, or a plugin package that provides one)"
        raise PluginError(f"unknown {self.kinds[kind].noun} {name!r}; {hint}")

    def _collect(self, kind: str) -> Catalogue:
        providers: dict[str, list[RegisteredPolicy]] = {}
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
                providers.setdefault(record.name, []).append(
                    RegisteredPolicy(kind, record, distribution, policy_kind.noun))
        by_name: dict[str, RegisteredPolicy] = {}
        by_qualified: dict[str, list[RegisteredPolicy]] = {}
        clashes: dict[str, NameClash] = {}
        for name, registered in providers.items():
            for policy in registered:
                by_qualified.setdefault(policy.qualified_name, []).append(policy)
            chosen = _bare_name_choice(registered)
            if chosen is not None:
                by_name[name] = chosen
            if len(registered) > 1:
                clashes[name] = NameClash(kind, name, tuple(registered), chosen)
        # One distribution registering a name twice: neither qualified name can tell them apart.
        unique = {qualified: found[0] for qualified, found in by_qualified.items() if len(found) == 1}
        return Catalogue(by_name, unique, clashes)

    def describe(self) -> dict[str, list[dict[str, str]]]:
        """Every policy by kind: name, qualified name, distribution, description, and for a
        name several distributions register, what selecting it does (for `servelab plugins`)."""
        listing = {}
        for kind in self.kinds:
            catalogue = self.catalogue(kind)
            entries = []
            for policy in sorted(catalogue.by_qualified_name.values(), key=lambda p: (p.name, p.distribution)):
                entry = {"name": policy.name, "qualified_name": policy.qualified_name,
                         "distribution": policy.distribution, "description": policy.plugin.description}
                clash = catalogue.clashes.get(policy.name)
                if clash is not None:
                    entry["clash"] = clash.describe()
                entries.append(entry)
            listing[kind] = entries
        return listing


def _bare_name_choice(providers: list[RegisteredPolicy]) -> RegisteredPolicy | None:
    """Who a bare name shared by `providers` selects: the only one; else the only
    third-party one where the rest are servelab's built-ins; else nobody."""
    if len(providers) == 1:
        return providers[0]
    third_party = [p for p in providers if p.distribution != BUILTIN_DISTRIBUTION]
    return third_party[0] if len(third_party) == 1 else None


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

"""The policy kinds, in one table, and the typed records registration hooks return.

Everything spelled per kind elsewhere is read off `KINDS`: the registry's hook names
and error words, the config's sections and defaults, the record classes below. Adding a
kind is a row here, its contract module in `servelab.contracts` (its Protocol, context
record and capabilities; `PolicyKind.contract` names it) and its registration hookspec in
`servelab.hookspecs`.
"""

from __future__ import annotations

import importlib
import re
from typing import Any, Callable, Iterable, Mapping

import attrs

from servelab.contracts import (adapter_residency, allocator, attention, drafter, eviction, kv_transfer,
                                logits_processor, router, scheduler, victim)
from servelab.errors import PluginError

_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]*$")


def _check_name(instance: Any, attribute: attrs.Attribute, value: str) -> None:
    if not isinstance(value, str) or not _NAME_RE.match(value):
        raise PluginError(
            f"plugin name {value!r} is invalid: use lower-case letters, digits, '-', '_' or '.'"
        )


@attrs.define(frozen=True)
class NoOptions:
    """Options class for policies that take none."""


@attrs.frozen(kw_only=True)
class PolicyPlugin:
    """A policy a plugin registers.

    `factory` is either a callable or a "module:attribute" string imported only when
    the policy is selected, so that listing plugins never imports torch or CuPy.
    It is called as `factory(options, context)` with an instance of `options` and the
    kind's context record (AllocatorContext, SchedulerContext, ...).
    """

    name: str = attrs.field(validator=_check_name)
    factory: Callable[..., Any] | str
    options: type = NoOptions
    description: str = ""
    # The version of its kind's contract the policy was written against
    # (`KINDS[kind].version`); None: the first version, with a warning once.
    contract_version: int | None = None

    def load_factory(self) -> Callable[..., Any]:
        if callable(self.factory):
            return self.factory
        module_name, _, attribute = self.factory.partition(":")
        module = importlib.import_module(module_name)
        return getattr(module, attribute)


@attrs.frozen
class PolicyKind:
    """One kind of policy: every word and name the rest of servelab uses for it.

    `key` names the kind in the registry (`registry.policies("allocators")`) and in its
    hook, `servelab_register_<key>`; `section` is its config section (`[allocator]`);
    `noun` is what error messages call one ("unknown attention backend 'x'").
    `selectable`: a config chooses one by name in `section` (logits processors are not
    chosen: every installed one is built, and each request picks its own). `default`:
    the policy used when the config names none (None: no policy of this kind).
    `optional`: without a section the config holds None (the drafter: off; the router:
    read only by fleets, which fall back to `default`); otherwise the section defaults
    to `default`.
    """

    key: str
    section: str
    noun: str
    record_name: str  # the class of its registration records, e.g. "AllocatorPlugin"
    protocol: type  # what its factory builds (its contract module, servelab.contracts.<kind>)
    context: type  # what its factory is called with (the same module)
    default: str | None = None
    selectable: bool = True
    optional: bool = False
    # The contract's version, the oldest one a plugin may still declare, and per later
    # version what changed (docs/contract-versions.md).
    version: int = 1
    oldest_compatible: int = 1
    changes: tuple[tuple[int, str], ...] = ()
    # For a kind another kind's option names (the victim: `[scheduler] preemption`), that
    # option; such a kind has no config section of its own.
    selected_by: str | None = None
    record: type = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "record", _record_class(self))

    @property
    def contract(self) -> str:
        """The module holding this kind's whole contract (servelab.contracts.<kind>)."""
        return self.protocol.__module__

    @property
    def hook_name(self) -> str:
        return f"servelab_register_{self.key}"

    def changes_since(self, version: int) -> str:
        """What changed in this contract after `version`, newest last."""
        return "; ".join(f"version {v}: {what}" for v, what in self.changes if v > version) or "nothing recorded"


def _record_class(kind: PolicyKind) -> type:
    """The kind's PolicyPlugin subclass (named `kind.record_name`, living in this module)."""
    namespace = {"__doc__": f"A{'n' if kind.noun[0] in 'aeiou' else ''} {kind.noun}: factory(options, "
                            f"{kind.context.__name__}) -> {kind.protocol.__name__}.",
                 "__module__": __name__, "__qualname__": kind.record_name}
    return attrs.frozen(kw_only=True)(type(kind.record_name, (PolicyPlugin,), namespace))


def kinds_table(kinds: Iterable[PolicyKind]) -> dict[str, PolicyKind]:
    """`kinds` by key, refusing a key or section used twice."""
    table: dict[str, PolicyKind] = {}
    for kind in kinds:
        clash = next((k for k in table.values() if kind.key == k.key or kind.section == k.section), None)
        if clash is not None:
            raise PluginError(f"policy kind {kind.key!r} clashes with {clash.key!r} (key or config section)")
        table[kind.key] = kind
    return table


KINDS: dict[str, PolicyKind] = kinds_table([
    # key, config section, noun in errors, record class, what the factory builds, and gets
    PolicyKind("allocators", "allocator", "allocator", "AllocatorPlugin",
               allocator.KVAllocator, allocator.AllocatorContext, default="paged", version=2, changes=(
                   (2, "reset_prefix_cache moved out of PrefixCachingAllocator into the optional "
                       "ResettablePrefixCache capability; AllocatorContext gained `eviction`"),)),
    PolicyKind("schedulers", "scheduler", "scheduler", "SchedulerPlugin",
               scheduler.Scheduler, scheduler.SchedulerContext, default="continuous"),
    PolicyKind("drafters", "drafter", "drafter", "DrafterPlugin",
               drafter.Drafter, drafter.DrafterContext, optional=True, version=3, changes=(
                   (2, "the optional AcceptingDrafter capability: accepted(request_id, token_ids) after "
                       "each verification"),
                   (3, "token trees: Draft.parents (a field with a default, None: a chain) and the optional "
                       "TreeDrafter capability (proposes_trees), which the engine refuses at start unless the "
                       "attention backend supports tree masks"),)),
    PolicyKind("attention", "attention", "attention backend", "AttentionPlugin",
               attention.AttentionBackend, attention.AttentionContext, default="cpu-paged"),
    PolicyKind("routers", "router", "router", "RouterPlugin",
               router.Router, router.RouterContext, default="round-robin", optional=True, version=2,
               changes=((2, "RouteRequest gained `session` (None unless the caller gives one)"),)),
    PolicyKind("logits_processors", "logits_processors", "logits processor", "LogitsProcessorPlugin",
               logits_processor.LogitsProcessor, logits_processor.LogitsProcessorContext, selectable=False),
    PolicyKind("evictors", "eviction", "eviction policy", "EvictionPlugin",
               eviction.EvictionPolicy, eviction.EvictionContext, default="lru"),
    # Named by the scheduler's `preemption` option, not a section of its own.
    PolicyKind("victims", "preemption", "preemption victim", "VictimPlugin",
               victim.VictimPolicy, victim.VictimContext, default="newest", selectable=False,
               selected_by="[scheduler] preemption"),
    # Read by disaggregated deployments (servelab.disagg); one engine ignores it.
    PolicyKind("kv_transfers", "kv_transfer", "KV transport", "KVTransferPlugin",
               kv_transfer.KVTransport, kv_transfer.KVTransferContext, default="in-process", optional=True),
    # Which LoRA adapters stay in the fast pool (docs/lora.md).
    PolicyKind("adapter_residency", "adapter_residency", "adapter residency policy", "AdapterResidencyPlugin",
               adapter_residency.AdapterResidencyPolicy, adapter_residency.ResidencyContext, default="lru"),
])


def kind_of_section(section: str, kinds: Mapping[str, PolicyKind] = KINDS) -> PolicyKind:
    """The kind whose config section is `section` ("allocator" -> the allocators)."""
    for kind in kinds.values():
        if kind.section == section:
            return kind
    raise PluginError(f"no policy kind has the config section [{section}]; sections are "
                      f"{', '.join(k.section for k in kinds.values())}")


# The names the table implies, for the code and plugins that import them.
POLICY_KINDS: tuple[str, ...] = tuple(KINDS)
RECORDS: dict[str, type] = {kind.record_name: kind.record for kind in KINDS.values()}
globals().update(RECORDS)  # AllocatorPlugin, SchedulerPlugin, ... importable from here

__all__ = ["KINDS", "NoOptions", "POLICY_KINDS", "PolicyKind", "PolicyPlugin", "kind_of_section", *RECORDS]

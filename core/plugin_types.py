"""The typed records registration hooks return: one per policy a plugin provides."""

from __future__ import annotations

import importlib
import re
from typing import Any, Callable

import attrs

from servelab.errors import PluginError

_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]*$")

POLICY_KINDS = ("allocators", "schedulers", "drafters", "attention", "routers", "logits_processors")


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

    def load_factory(self) -> Callable[..., Any]:
        if callable(self.factory):
            return self.factory
        module_name, _, attribute = self.factory.partition(":")
        module = importlib.import_module(module_name)
        return getattr(module, attribute)


@attrs.frozen(kw_only=True)
class AllocatorPlugin(PolicyPlugin):
    """A KV allocator: factory(options, AllocatorContext) -> KVAllocator."""


@attrs.frozen(kw_only=True)
class SchedulerPlugin(PolicyPlugin):
    """A scheduler: factory(options, SchedulerContext) -> Scheduler."""


@attrs.frozen(kw_only=True)
class DrafterPlugin(PolicyPlugin):
    """A drafter: factory(options, DrafterContext) -> Drafter."""


@attrs.frozen(kw_only=True)
class AttentionPlugin(PolicyPlugin):
    """An attention backend: factory(options, AttentionContext) -> AttentionBackend."""


@attrs.frozen(kw_only=True)
class RouterPlugin(PolicyPlugin):
    """A request router over engine replicas: factory(options, RouterContext) -> Router."""


@attrs.frozen(kw_only=True)
class LogitsProcessorPlugin(PolicyPlugin):
    """A logits processor: factory(options, LogitsProcessorContext) -> LogitsProcessor."""

"""What every contract class shares: finding the policy under test, hypothesis settings,
and failures that name the invariant they broke.

A contract is a plain class whose `test_*` methods pytest collects in any subclass
named `Test*`. The policy under test comes from one of:

- `factory = make_mine`: any callable `factory(options, context)` (a class works too);
- `plugin_name = "mine"`: the policy of that name installed through entry points, with
  its options class's defaults unless `options` is set;
- a `servelab_factory` fixture defined in the subclass, for factories that need other
  fixtures (a temporary directory, a GPU).

Nothing here imports torch, transformers or hypothesis: the contracts import them
inside the tests that need them, so `import servelab.testing` stays cheap.
"""

from __future__ import annotations

import contextlib
import functools
import traceback
from typing import Any, Callable, Iterator

import pytest

from servelab.errors import PluginError

UNDER_TEST = "contract-under-test"  # the name a factory-only policy is registered under for end-to-end runs


class ContractViolation(AssertionError):
    """A policy broke an invariant of its contract; the message starts with
    "invariant violated: <name>"."""


def check(condition: Any, invariant: str, detail: str | Callable[[], str] = "") -> None:
    """Raise ContractViolation naming `invariant` unless `condition` holds.

    `detail` may be a callable, formatted only on failure (checks run in hot loops).
    """
    if condition:
        return
    text = detail() if callable(detail) else detail
    raise ContractViolation(f"invariant violated: {invariant}" + (f": {text}" if text else ""))


@contextlib.contextmanager
def exercising(invariant: str) -> Iterator[None]:
    """Report any exception raised inside as a violation of `invariant` (the one the
    enclosed calls exercise), with the policy's traceback in the message."""
    try:
        yield
    except ContractViolation:
        raise
    except Exception as error:
        trace = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        raise ContractViolation(f"invariant violated: {invariant}: the policy raised "
                                f"{type(error).__name__}: {error}\n\n{trace}") from error


def _class_attribute(cls: type, name: str) -> Any:
    """A class attribute as written: a function assigned in a class body stays unbound."""
    for klass in cls.__mro__:
        if name in vars(klass):
            value = vars(klass)[name]
            return value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
    return None


@functools.lru_cache(maxsize=None)
def _installed_registry():
    """The entry-point registry, loaded once per process (read only: never registered into)."""
    from servelab.registry import PluginRegistry

    return PluginRegistry.from_entry_points()


def installed_factory(kind: str, name: str) -> tuple[Callable[..., Any], type]:
    """(factory, options class) of the installed policy `name` of `kind` ("allocators", ...)."""
    registered = _installed_registry().select(kind, name)
    return registered.plugin.load_factory(), registered.plugin.options


class PolicyContract:
    """Base of the policy contracts (one per kind); subclasses set `kind` and write the tests."""

    kind = ""  # "allocators", "schedulers", "drafters", "attention", "routers"
    factory: Callable[..., Any] | None = None  # factory(options, context) -> policy
    plugin_name: str | None = None  # or: the installed policy of this name
    options: Any = None  # options instance handed to the factory (default: the options class's defaults)
    # Hypothesis budget per randomised test; `pytest --servelab-max-examples=N` overrides it.
    # Runs are derandomized (the same examples every run) unless `--servelab-random` is given.
    max_examples = 30

    @pytest.fixture
    def servelab_factory(self) -> Callable[..., Any]:
        """The policy's factory; override this fixture to build it from other fixtures."""
        factory = _class_attribute(type(self), "factory")
        name = _class_attribute(type(self), "plugin_name")
        if factory is None and name is None:
            raise PluginError(f"{type(self).__name__}: set `factory = ...` or `plugin_name = ...` "
                              f"(or define a `servelab_factory` fixture) to say which policy the contract tests")
        if factory is None:
            factory, _ = installed_factory(self.kind, name)
        return factory

    @pytest.fixture
    def servelab_options(self) -> Any:
        """The options instance handed to the factory."""
        options = _class_attribute(type(self), "options")
        name = _class_attribute(type(self), "plugin_name")
        if options is None and name is not None and _class_attribute(type(self), "factory") is None:
            _, options_class = installed_factory(self.kind, name)
            options = options_class()
        return options

    @pytest.fixture(autouse=True)
    def _servelab_contract_setup(self, request, servelab_factory, servelab_options) -> None:
        self._factory = servelab_factory
        self._options = servelab_options
        # Selected by name from the installed plugins, exactly as a config would select it?
        overridden = any("servelab_factory" in vars(k) for k in type(self).__mro__ if k is not PolicyContract)
        self._uses_installed = (_class_attribute(type(self), "plugin_name") is not None and not overridden
                                and _class_attribute(type(self), "factory") is None
                                and _class_attribute(type(self), "options") is None)
        override = request.config.getoption("servelab_max_examples", default=None)
        self._max_examples = override or self.max_examples
        self._derandomize = not request.config.getoption("servelab_random", default=False)

    def make(self, context: Any) -> Any:
        """A fresh policy instance for `context`."""
        return self._factory(self._options, context)

    def hypothesis_settings(self, **overrides: Any):
        from hypothesis import HealthCheck, settings

        values = dict(max_examples=self._max_examples, deadline=None, derandomize=self._derandomize,
                      suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                             HealthCheck.filter_too_much])
        values.update(overrides)
        return settings(**values)

    def policy_section(self) -> tuple[str, Any]:
        """(name, registry) selecting this policy in an engine config, other kinds installed."""
        from servelab.registry import PluginRegistry

        registry = PluginRegistry.from_entry_points()
        if self._uses_installed:
            return _class_attribute(type(self), "plugin_name"), registry
        registry.register(_runtime_plugin(self.kind, self._factory, self._options), name=UNDER_TEST)
        return UNDER_TEST, registry


def _runtime_plugin(kind: str, factory: Callable[..., Any], options: Any) -> Any:
    """A plugin object registering `factory` (called with `options`) as UNDER_TEST."""
    import servelab
    from servelab.plugin_types import KINDS

    record_type, hook = KINDS[kind].record, KINDS[kind].hook_name
    record = record_type(name=UNDER_TEST, factory=lambda _options, context: factory(options, context),
                         description="the policy a conformance contract is testing")

    class UnderTest:
        pass

    setattr(UnderTest, hook, servelab.hookimpl(lambda self: [record]))
    return UnderTest()

"""What every contract class shares: finding the policy under test, hypothesis settings,
and failures that name the invariant they broke.

A contract is a plain class whose `test_*` methods pytest collects in any subclass
named `Test*`. The policy under test comes from one of:

- `factory = make_mine`: any callable `factory(options, context)` (a class works too);
- `plugin_name = "mine"`: the policy of that name installed through entry points, with
  its options class's defaults unless `options` is set;
- a `servelab_factory` fixture defined in the subclass, for factories that need other
  fixtures (a temporary directory, a GPU).

The policy is checked against the contract version it declares: the class attribute
`contract_version`, else its installed record's (`plugin_name`, or a factory some
installed record names), where no version means version 1 for a third-party policy and
the current version for servelab's own; a factory no record names is checked against the
current version. A rule a later version added is skipped for it (`since`), a rule about
an optional capability runs only on a policy that implements it (`require`), and every
failure names the contract, its version and where that version came from.

Nothing here imports torch, transformers or hypothesis: the contracts import them
inside the tests that need them, so `import servelab.testing` stays cheap.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import traceback
from typing import Any, Callable, Iterator

import pytest

from servelab.errors import PluginError

UNDER_TEST = "contract-under-test"  # the name a factory-only policy is registered under for end-to-end runs


class ContractViolation(AssertionError):
    """A policy broke an invariant of its contract; the message starts with
    "invariant violated: <name>" and ends naming the contract version checked."""


# The contract version the running contract test checks, named in every violation:
# "(allocator contract version 1, declared by ...)"; set while a contract test runs.
_checking: list[str] = []
_ADDED_IN: dict[str, int] = {}  # contract test (module.qualname) -> the version that added its rule


def _violation(message: str) -> ContractViolation:
    return ContractViolation(message + (f"\n({_checking[-1]})" if _checking else ""))


def since(version: int) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Mark a contract test as a rule version `version` of its contract added: a policy
    declaring an earlier version skips it."""

    def mark(test: Callable[..., Any]) -> Callable[..., Any]:
        _ADDED_IN[f"{test.__module__}.{test.__qualname__}"] = version
        return test

    return mark


def check(condition: Any, invariant: str, detail: str | Callable[[], str] = "") -> None:
    """Raise ContractViolation naming `invariant` unless `condition` holds.

    `detail` may be a callable, formatted only on failure (checks run in hot loops).
    """
    if condition:
        return
    text = detail() if callable(detail) else detail
    raise _violation(f"invariant violated: {invariant}" + (f": {text}" if text else ""))


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
        raise _violation(f"invariant violated: {invariant}: the policy raised "
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


def _record_naming(kind: str, factory: Callable[..., Any]) -> Any:
    """The installed record (a RegisteredPolicy) whose factory is `factory`, or None."""
    named = inspect.isfunction(factory) or inspect.isclass(factory)
    spelled = f"{factory.__module__}:{factory.__qualname__}" if named else None
    for registered in _installed_registry().policies(kind).values():
        if registered.plugin.factory is factory or registered.plugin.factory == spelled:
            return registered
    return None


def declared_version(cls: type, kind: str, factory: Callable[..., Any] | None) -> tuple[int, str]:
    """(the contract version a contract class checks its policy against, where it came from)."""
    from servelab.plugin_types import KINDS
    from servelab.registry import BUILTIN_DISTRIBUTION

    current = KINDS[kind].version
    stated = _class_attribute(cls, "contract_version")
    if stated is not None:
        return stated, f"contract_version = {stated} on {cls.__name__}"
    name = _class_attribute(cls, "plugin_name")
    registered = None
    if name is not None:
        registered = _installed_registry().select(kind, name)
    elif factory is not None:
        registered = _record_naming(kind, factory)
    if registered is None:
        return current, "the current version: no installed record names this factory"
    where = f"{registered.noun} {registered.name!r} from distribution {registered.distribution!r}"
    if registered.plugin.contract_version is not None:
        return registered.plugin.contract_version, f"declared by {where}"
    if registered.distribution == BUILTIN_DISTRIBUTION:
        return current, f"{where}, which moves with its contract"
    return 1, f"{where} declares none: version 1"


class PolicyContract:
    """Base of the policy contracts (one per kind); subclasses set `kind` and write the tests."""

    kind = ""  # "allocators", "schedulers", "drafters", "attention", "routers"
    factory: Callable[..., Any] | None = None  # factory(options, context) -> policy
    plugin_name: str | None = None  # or: the installed policy of this name
    options: Any = None  # options instance handed to the factory (default: the options class's defaults)
    # The contract version the policy is checked against (None: its record's, see the module docstring).
    contract_version: int | None = None
    _declared: tuple[int, str] | None = None  # (version, where from), set for each test
    # Hypothesis budget per randomised test; `pytest --servelab-max-examples=N` overrides it.
    # Runs are derandomized (the same examples every run) unless `--servelab-random` is given.
    max_examples = 30

    @pytest.fixture
    def servelab_factory(self) -> Callable[..., Any]:
        """The policy's factory; override this fixture to build it from other fixtures."""
        return self.declared_factory()

    def declared_factory(self) -> Callable[..., Any]:
        """The factory `factory` or `plugin_name` names."""
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
    def _servelab_contract_setup(self, request, servelab_factory, servelab_options) -> Iterator[None]:
        from servelab.plugin_types import KINDS

        self._declared = declared_version(type(self), self.kind, servelab_factory)
        version, where = self._declared
        noun = KINDS[self.kind].noun
        test = request.function
        added = _ADDED_IN.get(f"{test.__module__}.{test.__qualname__}", 1)
        if added > version:
            pytest.skip(f"a rule of {noun} contract version {added}; the policy is checked against version "
                        f"{version} ({where})")
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
        _checking.append(f"{noun} contract version {version}: {where}")
        try:
            yield
        finally:
            _checking.pop()

    @property
    def version(self) -> int:
        """The contract version this policy is checked against."""
        if self._declared is None:  # a contract built outside pytest's fixtures
            from servelab.plugin_types import KINDS

            return self.contract_version or KINDS[self.kind].version
        return self._declared[0]

    def require(self, policy: Any, capability: type) -> None:
        """Skip the running test unless `policy` implements the optional `capability`."""
        if not isinstance(policy, capability):
            pytest.skip(f"a rule of the optional capability {capability.__name__}, which "
                        f"{type(policy).__name__} does not implement")

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

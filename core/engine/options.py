"""Validators for policy options classes, public for plugins.

A policy's options are an attrs class whose fields are the keys of its config section;
these validators check a value and raise a ConfigError that names the section and key:

    import attrs
    from servelab.options import non_negative_number, one_of, positive_int

    @attrs.frozen(kw_only=True)
    class MyOptions:
        window: int = attrs.field(default=8, validator=positive_int("scheduler"))
        aging_s: float = attrs.field(default=10.0, validator=non_negative_number("scheduler"))
        order: str = attrs.field(default="fifo", validator=one_of("scheduler", ("fifo", "lifo")))

    MyOptions(window=0)  # ConfigError: [scheduler] window must be a positive integer, got 0

`section` is the config section the options come from ("allocator", "scheduler",
"drafter", "attention", "router", "logits_processors"; servelab.plugin_types.KINDS).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import attrs

from servelab.errors import ConfigError

Validator = Callable[[Any, attrs.Attribute, Any], None]

__all__ = ["boolean", "non_negative_int", "non_negative_number", "number_at_least", "one_of", "positive_int"]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def positive_int(section: str, *, optional: bool = False) -> Validator:
    """An integer >= 1 (`optional`: or None)."""
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if optional and value is None:
            return
        if not _is_int(value) or value < 1:
            raise ConfigError(f"[{section}] {attribute.name} must be a positive integer, got {value!r}")
    return check


def non_negative_int(section: str) -> Validator:
    """An integer >= 0."""
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if not _is_int(value) or value < 0:
            raise ConfigError(f"[{section}] {attribute.name} must be an integer >= 0, got {value!r}")
    return check


def number_at_least(section: str, minimum: float) -> Validator:
    """An int or float >= `minimum`."""
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if not _is_number(value) or value < minimum:
            raise ConfigError(f"[{section}] {attribute.name} must be a number >= {minimum:g}, got {value!r}")
    return check


def non_negative_number(section: str) -> Validator:
    """An int or float >= 0."""
    return number_at_least(section, 0)


def one_of(section: str, choices: Iterable[str]) -> Validator:
    """One of `choices`."""
    allowed = tuple(choices)

    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value not in allowed:
            raise ConfigError(f"[{section}] {attribute.name} must be one of {', '.join(map(repr, allowed))}, "
                              f"got {value!r}")
    return check


def boolean(section: str) -> Validator:
    """true or false (not 0 or 1)."""
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if not isinstance(value, bool):
            raise ConfigError(f"[{section}] {attribute.name} must be true or false, got {value!r}")
    return check

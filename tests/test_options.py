"""servelab.options: the validators options classes use, with errors naming [section] key."""

from __future__ import annotations

import attrs
import pytest

from servelab.errors import ConfigError
from servelab.options import boolean, non_negative_int, non_negative_number, number_at_least, one_of, positive_int


@attrs.frozen(kw_only=True)
class Options:
    window: int = attrs.field(default=1, validator=positive_int("scheduler"))
    limit: int | None = attrs.field(default=None, validator=positive_int("engine", optional=True))
    blocks: int = attrs.field(default=0, validator=non_negative_int("drafter"))
    aging_s: float = attrs.field(default=0.0, validator=non_negative_number("scheduler"))
    padding: float = attrs.field(default=1.0, validator=number_at_least("attention", 1.0))
    order: str = attrs.field(default="fifo", validator=one_of("router", ("fifo", "lifo")))
    fast: bool = attrs.field(default=True, validator=boolean("attention"))


def test_valid_values_pass():
    assert Options(window=3, limit=7, blocks=2, aging_s=0.5, padding=1, order="lifo", fast=False).padding == 1


@pytest.mark.parametrize("values, message", [
    ({"window": 0}, r"\[scheduler\] window must be a positive integer, got 0"),
    ({"window": True}, r"\[scheduler\] window must be a positive integer, got True"),
    ({"limit": 0}, r"\[engine\] limit must be a positive integer, got 0"),
    ({"blocks": -1}, r"\[drafter\] blocks must be an integer >= 0, got -1"),
    ({"blocks": 1.5}, r"\[drafter\] blocks must be an integer >= 0, got 1.5"),
    ({"aging_s": -0.1}, r"\[scheduler\] aging_s must be a number >= 0, got -0.1"),
    ({"padding": 0.9}, r"\[attention\] padding must be a number >= 1, got 0.9"),
    ({"order": "random"}, r"\[router\] order must be one of 'fifo', 'lifo', got 'random'"),
    ({"fast": 1}, r"\[attention\] fast must be true or false, got 1"),
])
def test_a_bad_value_is_a_config_error_naming_section_and_key(values, message):
    with pytest.raises(ConfigError, match=message):
        Options(**values)

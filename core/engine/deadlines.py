"""Deadlines and request classes of bench workloads: the generator options that set them
(`deadline_s`, `deadline_per_token_s`, `urgent_fraction`, `urgent_deadline_s`; see
servelab.workload) and the checks on a `file:` workload's `deadline` and `request_class`."""

from __future__ import annotations

import math
import random
from typing import Any

import attrs

from servelab.errors import ConfigError


def checked_deadline(value: Any, where: str) -> float | None:
    """A `file:` line's `deadline` (seconds > 0, or absent); `where` names the line."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{where}: deadline must be a number of seconds > 0, got {value!r}")
    return float(value)


def checked_request_class(value: Any, where: str) -> str | None:
    """A `file:` line's `request_class` (a non-empty label, or absent)."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: request_class must be a non-empty string, got {value!r}")
    return value


@attrs.frozen
class DeadlineOptions:
    """The generator options that give requests deadlines and classes (module doc)."""

    deadline_s: float | None = None
    deadline_per_token_s: float = 0.0
    urgent_fraction: float = 0.0
    urgent_deadline_s: float | None = None

    @classmethod
    def pop_from(cls, options: dict[str, Any]) -> "DeadlineOptions":
        values = {name: options.pop(name) for name in ("deadline_s", "deadline_per_token_s", "urgent_fraction",
                                                       "urgent_deadline_s") if name in options}
        for name, value in values.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (
                    value < 0 if name in ("deadline_per_token_s", "urgent_fraction") else value <= 0):
                raise ConfigError(f"workload {name} must be a number "
                                  f"{'>= 0' if name in ('deadline_per_token_s', 'urgent_fraction') else '> 0'}, "
                                  f"got {value!r}")
        made = cls(**{name: float(value) for name, value in values.items()})
        if made.urgent_fraction > 1:
            raise ConfigError(f"workload urgent_fraction must be in [0, 1], got {made.urgent_fraction}")
        if made.urgent_fraction and made.urgent_deadline_s is None:
            raise ConfigError("workload urgent_fraction needs urgent_deadline_s (the urgent requests' deadline)")
        if made.deadline_per_token_s and made.deadline_s is None and made.urgent_deadline_s is None:
            raise ConfigError("workload deadline_per_token_s needs deadline_s or urgent_deadline_s")
        return made

    def apply(self, requests: list[Any], seed: int) -> list[Any]:
        """`requests` with their deadlines and classes; unchanged without deadline options."""
        if self.deadline_s is None and self.urgent_deadline_s is None:
            return requests
        # A generator of their own: the same spec without these options gives the same requests.
        urgent = set(random.Random(seed + 2).sample(range(len(requests)), round(self.urgent_fraction * len(requests))))
        out = []
        for index, request in enumerate(requests):
            base, label = (self.urgent_deadline_s, "urgent") if index in urgent else (self.deadline_s, "standard")
            deadline = None if base is None else base + self.deadline_per_token_s * request.max_tokens
            out.append(attrs.evolve(request, deadline=deadline, request_class=label))
        return out

"""Options of the built-in adapter residency policies (no torch: read at discovery)."""

from __future__ import annotations

from typing import Any

import attrs

from servelab.errors import ConfigError


def _adapter_names(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, tuple) or not all(isinstance(name, str) and name for name in value):
        raise ConfigError(f"[adapter_residency] {attribute.name} must be a list of adapter names, got {value!r}")


def _as_tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


@attrs.frozen(kw_only=True)
class PinnedOptions:
    # Adapters (LoRARequest.lora_name) that leave the fast pool only when no other can. To
    # keep them resident always, set [engine] max_loras_per_batch to max_loras minus their count.
    pinned: tuple[str, ...] = attrs.field(default=(), converter=_as_tuple, validator=_adapter_names)

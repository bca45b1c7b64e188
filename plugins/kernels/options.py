"""Options classes of the built-in attention backends (importable without torch)."""

import attrs


@attrs.frozen
class TorchPagedOptions:
    """Group sizes trade padding and cache locality against per-group Python overhead."""

    decode_group_size: int = attrs.field(default=16, validator=attrs.validators.gt(0))  # sequences per decode group
    prefill_group_size: int = attrs.field(default=4, validator=attrs.validators.gt(0))  # per multi-token group

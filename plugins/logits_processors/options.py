"""Options classes of the built-in logits processors (importable without torch)."""

import attrs

from servelab.errors import NO_NEXT_TOKEN  # noqa: F401  (how the structured processor fails a dead-end row)


@attrs.frozen(kw_only=True)
class StructuredOptions:
    """`[logits_processors.structured]` options."""

    compile_timeout_s: float = attrs.field(default=10.0, validator=attrs.validators.gt(0))
    max_pending_compiles: int = attrs.field(default=16, validator=attrs.validators.gt(0))
    cache_size: int = attrs.field(default=256, validator=attrs.validators.gt(0))  # compiled grammars kept
    cache_bytes: int = attrs.field(default=256 * 2**20, validator=attrs.validators.gt(0))

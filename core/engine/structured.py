"""What a request's output must match: a JSON schema, any JSON object, a regular
expression or an EBNF grammar. The built-in `structured` logits processor
(servelab.plugins.logits_processors.structured) enforces it with xgrammar."""

from __future__ import annotations

import json
from typing import Any

import attrs

from servelab.errors import RequestError

KINDS = ("json", "json_object", "regex", "grammar")


@attrs.frozen
class StructuredOutput:
    """`kind` is one of KINDS; `spec` the schema (JSON text), pattern or grammar text
    ("" for json_object). Build with the class methods."""

    kind: str
    spec: str = ""

    def __attrs_post_init__(self) -> None:
        if self.kind not in KINDS:
            raise RequestError(f"structured output kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.spec, str):
            raise RequestError(f"structured output spec must be text, got {type(self.spec).__name__}")
        if self.kind != "json_object" and not self.spec:
            raise RequestError(f"structured output {self.kind} needs a non-empty {self.kind}")

    @classmethod
    def json(cls, schema: dict[str, Any] | str | bool) -> "StructuredOutput":
        """Output is JSON valid against `schema` (a dict, or its JSON text)."""
        if isinstance(schema, str):
            try:
                json.loads(schema)
            except ValueError as exc:
                raise RequestError(f"structured output json schema is not valid JSON: {exc}") from None
            except RecursionError:
                raise RequestError("structured output json schema nests too deep to parse") from None
            return cls("json", schema)
        if not isinstance(schema, (dict, bool)):
            raise RequestError(f"structured output json schema must be an object, got {type(schema).__name__}")
        try:
            return cls("json", json.dumps(schema, sort_keys=True))
        except (TypeError, ValueError) as exc:  # a value JSON cannot hold, or keys it cannot sort
            raise RequestError(f"structured output json schema is not JSON: {exc}") from None
        except RecursionError:
            raise RequestError("structured output json schema nests too deep to write as JSON") from None

    @classmethod
    def json_object(cls) -> "StructuredOutput":
        """Output is any JSON object."""
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> "StructuredOutput":
        """Output matches the regular expression `pattern` in full."""
        return cls("regex", pattern)

    @classmethod
    def grammar(cls, ebnf: str) -> "StructuredOutput":
        """Output is a sentence of the EBNF (GBNF-style) grammar, whose start symbol is `root`."""
        return cls("grammar", ebnf)

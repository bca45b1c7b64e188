"""What a request body may cost the server, checked before any of it is trusted.

The body is read with a size limit (413 as soon as Content-Length or the bytes received
pass it, before the rest is read) and a deadline (408 for a client that sends it too
slowly). It is then parsed as JSON with NaN / Infinity refused, nested at most
`max_json_depth` levels, and with every string valid Unicode (JSON may spell a lone
UTF-16 surrogate, "\\ud800", which no tokenizer can encode). Error messages quote
values through `brief`, so a 10 MB bad value is answered with a few dozen characters.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any, AsyncIterator

import attrs

from servelab.server.caps import RequestCaps
from servelab.server.protocol import ApiError, bad_request, brief

CHARS_PER_TOKEN_BOUND = 16  # prompt characters allowed per token of context (see max_prompt_chars)


@attrs.frozen(kw_only=True)
class RequestLimits:
    """The per-request bounds `servelab serve` enforces (each has a serve option)."""

    max_body_bytes: int = 2 * 1024 * 1024
    max_json_depth: int = 32
    body_timeout: float = 30.0  # seconds from the request's headers to its last body byte
    max_prompt_chars: int | None = None  # None: CHARS_PER_TOKEN_BOUND x max_model_len
    caps: RequestCaps = RequestCaps()  # what one request may ask for (counts and sizes)

    def prompt_chars(self, max_model_len: int) -> int:
        """Characters a prompt (or a chat's messages together) may hold before tokenization:
        a text this long has more tokens than the context unless its tokens average more
        than CHARS_PER_TOKEN_BOUND characters, so refusing it costs no legitimate request."""
        return self.max_prompt_chars if self.max_prompt_chars is not None else CHARS_PER_TOKEN_BOUND * max_model_len


async def read_body(chunks: AsyncIterator[bytes], content_length: str | None, limits: RequestLimits) -> bytes:
    """The whole body, or ApiError 413 (too big) / 408 (too slow) / 400 (bad Content-Length)."""
    if content_length is not None:
        try:
            declared = int(content_length)
        except ValueError:
            raise bad_request(f"Content-Length is not a number: {brief(content_length)}", None) from None
        if declared > limits.max_body_bytes:
            raise _too_large(limits)
    from starlette.requests import ClientDisconnect

    try:
        return await asyncio.wait_for(_collect(chunks, limits), limits.body_timeout)
    except ClientDisconnect:
        raise ApiError(499, "the client closed the request before its body was sent") from None
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {limits.body_timeout:g} s",
                       code="request_timeout", headers={"Connection": "close"}) from None


async def _collect(chunks: AsyncIterator[bytes], limits: RequestLimits) -> bytes:
    parts: list[bytes] = []
    size = 0
    async for chunk in chunks:
        size += len(chunk)
        if size > limits.max_body_bytes:
            raise _too_large(limits)
        parts.append(chunk)
    return b"".join(parts)


def _too_large(limits: RequestLimits) -> ApiError:
    return ApiError(413, f"the request body is larger than {limits.max_body_bytes} bytes", code="body_too_large",
                    headers={"Connection": "close"})


def parse_body(raw: bytes, limits: RequestLimits) -> dict[str, Any]:
    """The body as a JSON object, or a 400 naming what is wrong with it."""
    try:
        body = json.loads(raw, parse_constant=_refuse_constant)
    except RecursionError:
        raise _too_deep(limits) from None
    except ApiError:
        raise
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {brief(str(exc), 200)}", None,
                          "invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}", None, "invalid_json")
    _check_values(body, limits.max_json_depth, _may_hold_surrogates(raw))
    return body


def _refuse_constant(name: str) -> None:
    raise bad_request(f"the request body holds {name}, which is not a number JSON allows", None, "invalid_json")


def _too_deep(limits: RequestLimits) -> ApiError:
    return bad_request(f"the request body nests deeper than {limits.max_json_depth} levels", None, "invalid_json")


def _check_values(body: Any, max_depth: int, check_unicode: bool = True) -> None:
    """Depth of every container and, with `check_unicode`, Unicode of every string, without
    recursion (the depth is the client's choice)."""
    _check_depth(body, max_depth)
    if check_unicode:
        _check_unicode(body)


_CONTAINERS = (dict, list)


def _check_depth(body: Any, max_depth: int) -> None:
    """Containers only, one nesting level at a time: a megabyte of small objects costs tens
    of milliseconds, not a tuple per value."""
    level = [body] if type(body) in _CONTAINERS else []
    depth = 1
    while level:
        if depth > max_depth:
            raise bad_request(f"the request body nests deeper than {max_depth} levels", None, "invalid_json")
        children: list[Any] = []
        for value in level:
            children.extend([item for item in (value.values() if type(value) is dict else value)
                             if type(item) in _CONTAINERS])
        level = children
        depth += 1


# json.loads yields a lone surrogate only from a "\\udXXX" escape, or (it decodes with
# "surrogatepass") from UTF-8 bytes ED A0..BF, or from a body in UTF-16 / UTF-32
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _may_hold_surrogates(raw: bytes) -> bool:
    if json.detect_encoding(raw) != "utf-8":
        return True
    return b"\xed" in raw or _SURROGATE_ESCAPE.search(raw) is not None


def _check_unicode(body: Any) -> None:
    """Every string and key valid Unicode; a value's path is spelled out only for the error."""
    pending: list[tuple[Any, Any]] = [(body, None)]  # (value, (parent entry, key))
    while pending:
        entry = pending.pop()
        value = entry[0]
        if isinstance(value, str):
            if not _is_unicode(value):
                _check_text(value, _path(entry))
        elif isinstance(value, dict):
            for key, item in value.items():
                child = (item, (entry, key))
                if not _is_unicode(key):
                    _check_text(key, _path(child))
                pending.append(child)
        elif isinstance(value, list):
            pending.extend((item, (entry, index)) for index, item in enumerate(value))


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _path(entry: tuple[Any, Any]) -> str:
    parts = []
    while entry[1] is not None:
        entry, key = entry[1]
        parts.append(f".{key}" if isinstance(key, str) else f"[{key}]")
    return "".join(reversed(parts)).lstrip(".")


def _check_text(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad_request(f"{where or 'a key'} is not valid Unicode: it holds a lone surrogate "
                          f"{brief(exc.object[exc.start:exc.end])} at character {exc.start}", where or None,
                          "invalid_unicode") from None

"""The grammar compiler's process: xgrammar compilations, one at a time, killable.

xgrammar cannot interrupt a compilation, so it runs here, in a process of its own that
the engine kills when a compilation passes its time budget or loses its last waiter.
Messages are length-prefixed pickles on stdin / stdout: first the tokenizer's
`TokenizerInfo.serialize_json()`, answered ("ready", None) once the compiler is built
(the time budgets start then), then `(kind, spec)` per grammar, each acknowledged at once
with ("compiling", None) (so the engine tells a worker that died while it compiled from
one that had died before it took the grammar) and answered with
("ok", CompiledGrammar.serialize_json()) or ("error", message).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import struct
import sys
from typing import Any, BinaryIO

_HEADER = struct.Struct("<Q")


def encode_message(value: Any) -> bytes:
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(data)) + data


def write_message(fd: int, value: Any) -> None:
    """One message, written whole to the pipe `fd` with os.write. (A buffered writer drops
    bytes when a signal cuts a write to a pipe short, as stopping and continuing the
    process does: the reader then waits for bytes that never come.)"""
    view = memoryview(encode_message(value))
    while view:
        view = view[os.write(fd, view):]


def read_message(stream: BinaryIO) -> Any:
    """One message from a blocking stream; EOFError once the other side has closed the pipe."""
    size = _HEADER.unpack(_read_exactly(stream, _HEADER.size))[0]
    return pickle.loads(_read_exactly(stream, size))


def _read_exactly(stream: BinaryIO, count: int) -> bytes:
    chunks = []
    while count:
        chunk = stream.read(count)
        if not chunk:
            raise EOFError("the other side closed the pipe")
        chunks.append(chunk)
        count -= len(chunk)
    return b"".join(chunks)


def take_message(received: bytearray) -> tuple | None:
    """The first whole message in `received` (removed from it), None while it is incomplete."""
    if len(received) < _HEADER.size:
        return None
    end = _HEADER.size + _HEADER.unpack_from(received)[0]
    if len(received) < end:
        return None
    message = pickle.loads(received[_HEADER.size:end])
    del received[:end]
    return message


def first_line(exc: BaseException) -> str:
    """xgrammar's message without its C++ source location ("[12:00:00] /path/file.cc:42: ")."""
    text = str(exc).strip().splitlines()
    return re.sub(r"^\[[0-9:]+\] \S+:[0-9]+: ", "", text[0]) if text else type(exc).__name__


def compile_grammar(compiler: Any, kind: str, spec: str) -> Any:
    if kind == "json":
        return compiler.compile_json_schema(spec, any_whitespace=False)
    if kind == "json_object":
        return compiler.compile_json_schema(json.dumps({"type": "object"}), any_whitespace=False)
    if kind == "regex":
        return compiler.compile_regex(spec)
    return compiler.compile_grammar(spec)


def _die_with_parent() -> None:
    """Linux: killed when the engine's process ends, however it ends (even mid-compilation)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def main() -> None:
    _die_with_parent()
    import xgrammar

    requests, replies = sys.stdin.buffer, sys.stdout.fileno()
    info = xgrammar.TokenizerInfo.deserialize_json(read_message(requests))
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    write_message(replies, ("ready", None))
    while True:
        try:
            kind, spec = read_message(requests)
        except EOFError:
            return
        write_message(replies, ("compiling", None))
        try:
            reply = ("ok", compile_grammar(compiler, kind, spec).serialize_json())
        except Exception as exc:
            reply = ("error", first_line(exc))
        write_message(replies, reply)


if __name__ == "__main__":
    main()

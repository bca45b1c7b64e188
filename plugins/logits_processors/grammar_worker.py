"""The grammar compiler's process: xgrammar compilations, one at a time, killable.

xgrammar cannot interrupt a compilation, so it runs here, in a process of its own that
the engine kills when a compilation passes its time budget or loses its last waiter.
Messages are length-prefixed pickles on stdin / stdout: first the tokenizer's
`TokenizerInfo.serialize_json()`, answered ("ready", None) once the compiler is built
(the time budgets start then), then `(kind, spec)` per grammar, each answered with
("ok", CompiledGrammar.serialize_json()) or ("error", message).
"""

from __future__ import annotations

import json
import pickle
import re
import struct
import sys
from typing import Any, BinaryIO

_HEADER = struct.Struct("<Q")


def encode_message(value: Any) -> bytes:
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(data)) + data


def write_message(stream: BinaryIO, value: Any) -> None:
    stream.write(encode_message(value))
    stream.flush()


def read_message(stream: BinaryIO) -> Any:
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise EOFError("the other side closed the pipe")
    size = _HEADER.unpack(header)[0]
    data = stream.read(size)
    if len(data) < size:
        raise EOFError("the other side closed the pipe")
    return pickle.loads(data)


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

    requests, replies = sys.stdin.buffer, sys.stdout.buffer
    info = xgrammar.TokenizerInfo.deserialize_json(read_message(requests))
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    write_message(replies, ("ready", None))
    while True:
        try:
            kind, spec = read_message(requests)
        except EOFError:
            return
        try:
            write_message(replies, ("ok", compile_grammar(compiler, kind, spec).serialize_json()))
        except Exception as exc:
            write_message(replies, ("error", first_line(exc)))


if __name__ == "__main__":
    main()

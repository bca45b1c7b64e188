"""Published request traces as bench workloads: Mooncake's and Azure's LLM inference traces.

    mooncake:PATH[,OPTIONS]   JSONL, one request a line: `timestamp` (ms), `input_length`,
                              `output_length`, `hash_ids` (one id per 512-token block of
                              the prompt; equal ids at the same place mean equal blocks)
    azure:PATH[,OPTIONS]      CSV with a header: `TIMESTAMP` (a date and time, or seconds),
                              `ContextTokens`, `GeneratedTokens`

A Mooncake prompt is made block by block: the tokens of a hash id are drawn from a
generator seeded by that id, so two requests whose `hash_ids` start alike start with the
same tokens and a prefix cache serves the shared blocks; a block past `input_length` is
cut, a prompt longer than its blocks is filled with tokens of its own. Azure traces say
nothing of content: every prompt is drawn fresh.

Options (after the path, comma-separated `key=value`):

    speedup=F          arrivals F times as fast (2: the trace's gaps halved)
    every=K            keep every K-th request (the 1st, the K+1-th, ...)
    fraction=P,seed=S  keep each request with probability P (the draw seeded by S)
    first=N            keep the first N (of those the two above kept)
    hash_block_size=B  tokens a Mooncake hash id stands for (default 512)

and the deadline options of any generator (servelab.deadlines). Arrival offsets count
from the first kept request.
"""

from __future__ import annotations

import csv
import datetime
import json
import math
import random
from pathlib import Path
from typing import Any, Callable

import attrs

from servelab.deadlines import DeadlineOptions
from servelab.errors import ConfigError

TRACE_FORMATS = ("mooncake", "azure")
MOONCAKE_BLOCK_SIZE = 512


@attrs.frozen
class TraceRecord:
    """One request of a trace, before it has tokens."""

    arrival_s: float  # on the trace's own clock
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...] = ()


@attrs.frozen
class TraceOptions:
    """How a trace is replayed: time scaling and sub-sampling (module doc)."""

    speedup: float = 1.0
    every: int = 1
    fraction: float = 1.0
    first: int | None = None
    seed: int = 0
    hash_block_size: int = MOONCAKE_BLOCK_SIZE

    @classmethod
    def pop_from(cls, options: dict[str, Any], spec: str) -> "TraceOptions":
        made = cls(**{name: options.pop(name) for name in attrs.fields_dict(cls) if name in options})
        if options:
            raise ConfigError(f"unknown option(s) {', '.join(sorted(options))} for trace workload {spec!r}; "
                              f"choose from {', '.join(attrs.fields_dict(cls))} and the deadline options")
        number, whole = (int, float), int
        checks = {"speedup": (number, lambda v: v > 0), "every": (whole, lambda v: v >= 1),
                  "fraction": (number, lambda v: 0 < v <= 1), "first": (whole, lambda v: v >= 1),
                  "seed": (whole, lambda v: True), "hash_block_size": (whole, lambda v: v >= 1)}
        for name, (kind, in_range) in checks.items():
            value = getattr(made, name)
            if value is None and name == "first":
                continue
            if not isinstance(value, kind) or not in_range(value):
                raise ConfigError(f"trace workload option {name}={value!r} is out of range (speedup > 0, "
                                  "every >= 1, 0 < fraction <= 1, first >= 1, hash_block_size >= 1, seed an integer)")
        return made

    def sample(self, records: list[TraceRecord]) -> list[TraceRecord]:
        """every, then fraction, then first (module doc)."""
        kept = records[:: self.every]
        if self.fraction < 1:
            rng = random.Random(self.seed)
            kept = [r for r in kept if rng.random() < self.fraction]
        return kept[: self.first] if self.first is not None else kept


def split_trace_spec(rest: str) -> tuple[str, dict[str, Any]]:
    """`PATH,key=value,...` -> (PATH, options)."""
    path, *items = rest.split(",")
    if not path:
        raise ConfigError("a trace workload needs a path: mooncake:PATH or azure:PATH")
    options: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"trace workload option {item!r} must be key=value")
        options[key.strip()] = option_value(value.strip())
    return path, options


def read_mooncake(path: str) -> list[TraceRecord]:
    records = []
    for number, line in enumerate(_lines(path), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
            hash_ids = tuple(int(h) for h in row.get("hash_ids", ()))
            record = TraceRecord(float(row["timestamp"]) / 1000, int(row["input_length"]), int(row["output_length"]),
                                 hash_ids)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ConfigError(f"{where}: a Mooncake trace line needs timestamp (ms), input_length, output_length "
                              f"and hash_ids ({type(exc).__name__}: {exc})") from None
        records.append(_checked(record, where))
    return records


def read_azure(path: str) -> list[TraceRecord]:
    lines = _lines(path)
    reader = csv.DictReader(lines)
    missing = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} - set(reader.fieldnames or ())
    if missing:
        raise ConfigError(f"{path}: an Azure trace needs the columns TIMESTAMP, ContextTokens, GeneratedTokens; "
                          f"missing {', '.join(sorted(missing))}")
    records = []
    for number, row in enumerate(reader, 2):
        where = f"{path}:{number}"
        try:
            record = TraceRecord(_azure_seconds(row["TIMESTAMP"]), int(row["ContextTokens"]),
                                 int(row["GeneratedTokens"]))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{where}: bad Azure trace row ({exc})") from None
        records.append(_checked(record, where))
    return records


def _azure_seconds(text: str) -> float:
    """`2023-11-16 18:15:46.6805900` (any number of fractional digits) or plain seconds."""
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    whole, _, fraction = text.partition(".")
    moment = datetime.datetime.fromisoformat(whole)
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.timezone.utc)
    return moment.timestamp() + (float("0." + fraction) if fraction else 0.0)


def _checked(record: TraceRecord, where: str) -> TraceRecord:
    if not math.isfinite(record.arrival_s) or record.input_length < 1 or record.output_length < 1:
        raise ConfigError(f"{where}: a trace request needs a finite timestamp and input and output lengths >= 1, "
                          f"got {record.arrival_s}, {record.input_length}, {record.output_length}")
    return record


def _lines(path: str) -> list[str]:
    try:
        return Path(path).read_text().splitlines()
    except FileNotFoundError:
        raise ConfigError(f"trace file {path!r} does not exist") from None


def option_value(text: str) -> Any:
    """A workload option's value: an int, else a float, else the text."""
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


READERS = {"mooncake": read_mooncake, "azure": read_azure}


@attrs.frozen
class TracedRequest:
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_time: float  # seconds after the first kept request


def trace_requests(kind: str, rest: str, draw_tokens: Callable[[random.Random, int], list[int]]
                   ) -> tuple[list[TracedRequest], DeadlineOptions, int]:
    """The requests of trace `kind` (`rest` is `PATH,options`), sampled, scaled, in
    arrival order; the deadline options to apply and the seed. `draw_tokens(rng, n)`
    draws n token ids."""
    path, options = split_trace_spec(rest)
    deadlines = DeadlineOptions.pop_from(options)
    replay = TraceOptions.pop_from(options, f"{kind}:{rest}")
    records = replay.sample(READERS[kind](path))
    if not records:
        raise ConfigError(f"trace workload {kind}:{rest} keeps no request")
    start = min(r.arrival_s for r in records)
    blocks: dict[int, list[int]] = {}
    fresh = random.Random(replay.seed)
    requests = []
    for record in sorted(records, key=lambda r: r.arrival_s):
        prompt: list[int] = []
        for hash_id in record.hash_ids:
            if len(prompt) >= record.input_length:
                break
            if hash_id not in blocks:
                blocks[hash_id] = draw_tokens(random.Random(f"{replay.seed}:{hash_id}"), replay.hash_block_size)
            prompt += blocks[hash_id]
        prompt = prompt[: record.input_length]
        prompt += draw_tokens(fresh, record.input_length - len(prompt))
        requests.append(TracedRequest(prompt, record.output_length, round((record.arrival_s - start) / replay.speedup, 6)))
    return requests, deadlines, replay.seed

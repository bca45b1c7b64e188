"""A bounded load generator for `servelab serve`: many concurrent streaming completions
from one process, with client-side TTFT / TPOT and every outcome counted by kind.

    report = asyncio.run(run_load("http://127.0.0.1:8000", num_requests=200, concurrency=200))
    print(report.format())

Each request is a `stream: true` completion of a random word prompt with `ignore_eos`,
so a request that is answered must bring exactly `max_tokens` tokens. Outcomes:
"ok", "http_429" / "http_503" / "http_<status>" (refused), "aborted" (the stream ended
properly, with [DONE], but its finish_reason was "abort": a shutdown's deadline cut it),
"disconnected" (the first `num_disconnect` requests close their stream once half their
tokens came, as a client that goes away would), "incomplete" (the stream ended without
[DONE] or with the wrong token count), "connect_refused" (no server listening, as after
a shutdown) and "transport" (other connection errors, timeouts). TTFT and TPOT are of
the "ok" requests.
Streams go through sse_client (lean: the client shares the machine with the server it
measures); /metrics through httpx (in the serve extra).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from typing import Any

import attrs

from servelab.server.sse_client import StreamClosed, post_stream


@attrs.define
class LoadReport:
    """What a load run saw. Latencies are in seconds, measured by the client."""

    num_requests: int
    concurrency: int
    max_tokens: int
    seconds: float = 0.0
    outcomes: Counter = attrs.field(factory=Counter)
    ttft: list[float] = attrs.field(factory=list)
    tpot: list[float] = attrs.field(factory=list)
    output_tokens: int = 0
    server: dict[str, float] = attrs.field(factory=dict)  # /metrics after the run

    @property
    def errors(self) -> dict[str, int]:
        return {kind: count for kind, count in sorted(self.outcomes.items()) if kind != "ok"}

    @property
    def blocks_leaked(self) -> int | None:
        used = self.server.get('servelab_kv_blocks{state="used"}')
        return None if used is None else int(used)

    def server_quantile(self, name: str, q: float) -> float | None:
        """The q-quantile of a server histogram, interpolated in its bucket as Prometheus'
        histogram_quantile does (None before any observation)."""
        prefix = f'servelab_{name}_seconds_bucket{{le="'
        buckets = sorted((float(key[len(prefix):-2]), count) for key, count in self.server.items()
                         if key.startswith(prefix))
        if not buckets or buckets[-1][1] == 0:
            return None
        rank = q * buckets[-1][1]
        lower, below = 0.0, 0.0
        for bound, count in buckets:
            if count >= rank:
                if bound == float("inf"):
                    return lower
                return lower + (bound - lower) * (rank - below) / (count - below) if count > below else bound
            lower, below = bound, count
        return lower

    def format(self) -> str:
        ok = self.outcomes["ok"]
        lines = [
            f"requests {self.num_requests}, concurrency {self.concurrency}, max_tokens {self.max_tokens}, "
            f"{self.seconds:.2f} s",
            f"answered {ok}; errors by kind: {self.errors or 'none'}",
            f"TTFT p50 {_ms(percentile(self.ttft, 50))}, p99 {_ms(percentile(self.ttft, 99))}",
            f"TPOT p50 {_ms(percentile(self.tpot, 50))}, p99 {_ms(percentile(self.tpot, 99))}",
            f"output tokens delivered {self.output_tokens} ({self.output_tokens / self.seconds:.0f} tok/s)"
            if self.seconds else "output tokens 0",
            f"server-side (/metrics histograms, since it started): "
            f"TTFT p50 {_ms(self.server_quantile('time_to_first_token', 0.5))}, "
            f"p99 {_ms(self.server_quantile('time_to_first_token', 0.99))}; "
            f"TPOT p50 {_ms(self.server_quantile('time_per_output_token', 0.5))}, "
            f"p99 {_ms(self.server_quantile('time_per_output_token', 0.99))}",
            f"after the run: running {self.server.get('servelab_requests_running')}, "
            f"waiting {self.server.get('servelab_requests_waiting')}, KV blocks leaked {self.blocks_leaked}",
        ]
        return "\n".join(lines)


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile by nearest rank (None for no values)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.1f} ms"


def make_prompts(num_requests: int, prompt_words: tuple[int, int] = (4, 24), vocab: tuple[int, int] = (3, 211),
                 seed: int = 0) -> list[str]:
    """The random word prompts `run_load` sends (the same for the same arguments)."""
    rng = random.Random(seed)
    return [" ".join(f"w{rng.randrange(*vocab)}" for _ in range(rng.randint(*prompt_words)))
            for _ in range(num_requests)]


async def run_load(url: str, num_requests: int = 200, concurrency: int = 200, max_tokens: int = 8,
                   prompt_words: tuple[int, int] = (4, 24), model: str | None = None, api_key: str | None = None,
                   seed: int = 0, timeout: float = 60.0, vocab: tuple[int, int] = (3, 211),
                   num_disconnect: int = 0) -> LoadReport:
    """Send `num_requests` streaming completions, at most `concurrency` at a time; the
    first `num_disconnect` of them hang up halfway through their stream. `timeout` bounds
    each request, from its connection to its last event."""
    import httpx

    prompts = make_prompts(num_requests, prompt_words, vocab, seed)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    report = LoadReport(num_requests, concurrency, max_tokens)
    gate = asyncio.Semaphore(concurrency)
    started = time.perf_counter()

    async def one(index: int, prompt: str) -> None:
        body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True},
                "ignore_eos": True, "temperature": 0.0}
        if model is not None:
            body["model"] = model
        async with gate:
            try:
                await asyncio.wait_for(_stream_one(url, body, headers, report, hang_up=index < num_disconnect),
                                       timeout)
            except asyncio.TimeoutError:
                report.outcomes["transport"] += 1

    await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    report.seconds = time.perf_counter() - started
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout) as client:
        try:
            report.server = await settled_metrics(client)
        except httpx.HTTPError:  # the server has stopped (a shutdown during the run)
            report.server = {}
    return report


async def _stream_one(url: str, body: dict[str, Any], headers: dict[str, str], report: LoadReport,
                      hang_up: bool = False) -> None:
    sent = time.perf_counter()
    first = last = None
    num_tokens = num_deltas = 0
    done = aborted = False
    try:
        response = await post_stream(url, "/v1/completions", json.dumps(body).encode(), headers)
    except ConnectionRefusedError:  # nobody listens (any more): refused before a request was sent
        report.outcomes["connect_refused"] += 1
        return
    except (OSError, StreamClosed, ValueError):
        report.outcomes["transport"] += 1
        return
    try:
        if response.status != 200:
            await response.body()
            report.outcomes[f"http_{response.status}"] += 1
            return
        async for data in response.events():
            if data == b"[DONE]":
                done = True
                break
            chunk = json.loads(data)
            choices = chunk.get("choices", ())
            if chunk.get("usage"):
                num_tokens = chunk["usage"]["completion_tokens"]
            elif any(c.get("text") for c in choices):
                last = time.perf_counter()
                first = first or last
                num_deltas += 1
            aborted = aborted or any(c.get("finish_reason") == "abort" for c in choices)
            if hang_up and num_deltas >= body["max_tokens"] // 2:
                report.outcomes["disconnected"] += 1
                return  # closing the connection mid-stream
    except (OSError, StreamClosed, ValueError):
        report.outcomes["transport"] += 1
        return
    finally:
        response.close()
    if done and aborted:  # cut off by a shutdown's deadline: its tokens count, its latencies do not
        report.outcomes["aborted"] += 1
        report.output_tokens += num_tokens
        return
    if not done or num_tokens != body["max_tokens"]:
        report.outcomes["incomplete"] += 1
        return
    report.outcomes["ok"] += 1
    report.output_tokens += num_tokens
    if first is not None:
        report.ttft.append(first - sent)
        if num_tokens > 1:
            report.tpot.append((last - first) / (num_tokens - 1))


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {"name{labels}": value} (comments dropped)."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


async def settled_metrics(client: Any, wait: float = 5.0) -> dict[str, float]:
    """/metrics once nothing is running or waiting (or after `wait` seconds)."""
    deadline = time.perf_counter() + wait
    while True:
        metrics = parse_metrics((await client.get("/metrics")).text)
        idle = metrics.get("servelab_requests_running") == 0 and metrics.get("servelab_requests_waiting") == 0
        if idle or time.perf_counter() > deadline:
            return metrics
        await asyncio.sleep(0.05)

"""Seeded benchmark workloads: who asks for what, and when.

A workload is a list of requests (prompt token ids, output length, arrival offset in
seconds). Generators cover length-skewed traffic, shared-prefix traffic, multi-turn
conversations (one system prompt, or many of them with their own popularity and
arrivals), repetitive traffic, long-prompt bursts and fixed lengths; arrivals are
offline (all at t=0, but for the turns of a conversation), Poisson or bursty.
Workloads save to and replay from JSONL exactly.

Spec strings (`servelab bench --workload SPEC`):

    skewed:num_requests=64,mean_prompt_len=128,mean_output_len=128
    shared-prefix:num_groups=2,prefix_len=1000,num_requests=32
    multi-turn:num_conversations=8,num_turns=4,turn_gap_s=0.5
    conversations:num_system_prompts=64,num_conversations=256,num_turns=4,conversation_rate=4
    repetitive:passage_len=200,num_requests=16
    long-burst:num_long=4,long_len=2000,num_short=32
    fixed:num_requests=500,prompt_len=467,output_len=256,arrival=poisson,rate=16
    skewed:num_requests=200,arrival=poisson,rate=4
    fixed:num_requests=64,structured_fraction=0.5    # half the requests carry BENCH_SCHEMA
    fixed:num_requests=64,logprobs=5                 # every request asks for 5 logprobs
    file:requests.jsonl
    mooncake:trace.jsonl,speedup=2,first=200          # published traces (servelab.traces)
    azure:AzureLLMInferenceTrace_conv.csv,every=10

Any generator takes `structured_fraction` (that share of the requests, chosen by the
seed, must output JSON valid against BENCH_SCHEMA and ends when it is complete, at EOS)
and `logprobs` (every request asks for that many logprobs).

LoRA adapters (docs/lora.md): `adapters=N` gives each request one of N adapters, adapter
k drawn with weight 1 / (k + 1) ** adapter_zipf (default 1: a few popular adapters and a
long tail; 0: uniform); `base_fraction` of the requests (chosen by the seed) stay on the
base model. `servelab bench` writes the adapters themselves (servelab.bench.bench_adapters):

    skewed:num_requests=64,adapters=16,adapter_zipf=1.0,arrival=poisson,rate=4

Deadlines (per-request SLOs: seconds after arrival by which the request should finish,
handed to the engine as SamplingParams.deadline, which deadline-aware schedulers read):

    fixed:num_requests=64,deadline_s=2                      # every request, class "standard"
    skewed:deadline_s=1,deadline_per_token_s=0.05           # 1 s plus 50 ms an output token
    skewed:deadline_s=5,urgent_fraction=0.25,urgent_deadline_s=0.5
        # a quarter of the requests (chosen by the seed) are class "urgent" with a 0.5 s
        # deadline (plus deadline_per_token_s an output token); the rest "standard"

A `file:` workload's lines may carry `deadline` (seconds) and `request_class` (a label);
the bench reports deadline attainment and goodput per class.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any, Callable

import attrs

from servelab.deadlines import DeadlineOptions, checked_deadline, checked_request_class
from servelab.errors import ConfigError
from servelab.traces import TRACE_FORMATS, option_value, trace_requests

FIRST_TOKEN_ID = 3  # skip the usual <unk>/<s>/</s> ids


# A JSON schema with a bounded, fairly long output: 16 integers of up to 3 digits.
BENCH_SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
                "minItems": 16, "maxItems": 16}


@attrs.frozen
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_time: float = 0.0  # seconds after the run starts
    json_schema: bool = False  # the output must be JSON valid against BENCH_SCHEMA
    logprobs: int | None = None  # SamplingParams.logprobs
    deadline: float | None = None  # seconds after arrival by which it should finish (SamplingParams.deadline)
    request_class: str | None = None  # a label the bench groups attainment and goodput by
    adapter: int | None = None  # the LoRA adapter it runs with (the bench's adapter-<k>); None: the base model


@attrs.frozen
class Workload:
    name: str  # the spec it was generated from
    requests: tuple[BenchRequest, ...]
    # the LoRA adapters the requests name, by index (BenchRequest.adapter); set by the bench
    # once it has written them (servelab.bench.bench_adapters), not saved with the workload
    lora_requests: tuple[Any, ...] = attrs.field(default=(), eq=False)

    def save(self, path: str | Path) -> None:
        with open(path, "w") as handle:
            handle.write(json.dumps({"workload": self.name}) + "\n")
            for r in self.requests:
                extra = {**({"json_schema": True} if r.json_schema else {}),
                         **({"logprobs": r.logprobs} if r.logprobs is not None else {}),
                         **({"deadline": r.deadline} if r.deadline is not None else {}),
                         **({"request_class": r.request_class} if r.request_class is not None else {}),
                         **({"adapter": r.adapter} if r.adapter is not None else {})}
                handle.write(json.dumps({"prompt_token_ids": r.prompt_token_ids, "max_tokens": r.max_tokens,
                                         "arrival_time": r.arrival_time, **extra}) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "Workload":
        try:
            lines = Path(path).read_text().splitlines()
        except FileNotFoundError:
            raise ConfigError(f"workload file {str(path)!r} does not exist") from None
        name = f"file:{path}"
        requests = []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if "workload" in record and "prompt_token_ids" not in record:
                name = record["workload"]
                continue
            try:
                request = BenchRequest(list(record["prompt_token_ids"]), int(record["max_tokens"]),
                                       float(record.get("arrival_time", 0.0)),
                                       bool(record.get("json_schema", False)), record.get("logprobs"))
            except (KeyError, TypeError, ValueError) as exc:
                raise ConfigError(f"{path}:{number}: a request needs prompt_token_ids and max_tokens ({exc})") from None
            adapter = record.get("adapter")
            if adapter is not None and (isinstance(adapter, bool) or not isinstance(adapter, int) or adapter < 0):
                raise ConfigError(f"{path}:{number}: adapter must be an adapter index >= 0, got {adapter!r}")
            requests.append(attrs.evolve(request, deadline=checked_deadline(record.get("deadline"), f"{path}:{number}"),
                                         request_class=checked_request_class(record.get("request_class"),
                                                                      f"{path}:{number}"), adapter=adapter))
        return cls(name, tuple(requests))

    @property
    def num_adapters(self) -> int:
        """How many LoRA adapters the requests name (adapter indices 0..n-1)."""
        return 1 + max((r.adapter for r in self.requests if r.adapter is not None), default=-1)

    @property
    def num_output_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)


def lognormal_length(rng: random.Random, mean: float, sigma: float, low: int, high: int) -> int:
    """A log-normal draw with the given mean (mu = ln(mean) - sigma^2 / 2), clipped."""
    mu = math.log(mean) - sigma**2 / 2
    return max(low, min(int(rng.lognormvariate(mu, sigma)), high))


def _tokens(rng: random.Random, vocab_size: int, count: int) -> list[int]:
    """`count` draws of rng.randrange(FIRST_TOKEN_ID, vocab_size): the same numbers, drawn
    the way randrange draws them (getrandbits of the width's bit length, rejecting draws
    past the width), without its per-call overhead; millions are drawn for a big workload."""
    width = vocab_size - FIRST_TOKEN_ID
    if width <= 0:
        return [rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(count)]  # randrange's own error
    num_bits = width.bit_length()
    getrandbits = rng.getrandbits
    tokens = []
    append = tokens.append
    for _ in range(count):
        draw = getrandbits(num_bits)
        while draw >= width:
            draw = getrandbits(num_bits)
        append(FIRST_TOKEN_ID + draw)
    return tokens


def skewed(rng: random.Random, vocab_size: int, num_requests: int = 64, mean_prompt_len: int = 128,
           mean_output_len: int = 128, sigma: float = 0.8, max_len: int = 512) -> list[BenchRequest]:
    """Log-normal prompt and output lengths: many short requests, a few long ones."""
    out = []
    for _ in range(num_requests):
        prompt_len = lognormal_length(rng, mean_prompt_len, sigma, 1, max_len // 2)
        output_len = lognormal_length(rng, mean_output_len, sigma, 1, max_len // 2)
        out.append(BenchRequest(_tokens(rng, vocab_size, prompt_len), output_len))
    return out


def fixed(rng: random.Random, vocab_size: int, num_requests: int = 64, prompt_len: int = 128,
          output_len: int = 128) -> list[BenchRequest]:
    """Every request the same length, as in fixed input/output-length benchmark tables."""
    return [BenchRequest(_tokens(rng, vocab_size, prompt_len), output_len) for _ in range(num_requests)]


def shared_prefix(rng: random.Random, vocab_size: int, num_groups: int = 2, prefix_len: int = 1000,
                  num_requests: int = 32, tail_len: int = 32, output_len: int = 32, shuffle: int = 0) -> list[BenchRequest]:
    """A long common prefix per group (a system prompt) plus short distinct tails. Request
    i belongs to group i mod num_groups, or, with shuffle=1, to a group drawn at random
    (a fixed cycle lines groups up with a round-robin router's replicas)."""
    prefixes = [_tokens(rng, vocab_size, prefix_len) for _ in range(num_groups)]
    groups = [rng.randrange(num_groups) if shuffle else i % num_groups for i in range(num_requests)]
    return [BenchRequest(prefixes[group] + _tokens(rng, vocab_size, tail_len), output_len) for group in groups]


def multi_turn(rng: random.Random, vocab_size: int, num_conversations: int = 8, num_turns: int = 4,
               system_len: int = 128, user_len: int = 32, answer_len: int = 32, output_len: int = 32,
               turn_gap_s: float = 0.5) -> list[BenchRequest]:
    """Conversations sharing a system prompt: turn t's prompt is turn t-1's prompt plus an
    answer and a new user message, and arrives `turn_gap_s` seconds after it. (The
    answers are drawn here, not generated, so each turn reuses the previous turn's prompt.)"""
    system = _tokens(rng, vocab_size, system_len)
    histories = [system + _tokens(rng, vocab_size, user_len) for _ in range(num_conversations)]
    out = []
    for turn in range(num_turns):
        for index in range(num_conversations):
            if turn:
                histories[index] = (histories[index] + _tokens(rng, vocab_size, answer_len)
                                    + _tokens(rng, vocab_size, user_len))
            out.append(BenchRequest(list(histories[index]), output_len, arrival_time=round(turn * turn_gap_s, 6)))
    return out


def conversations(rng: random.Random, vocab_size: int, num_system_prompts: int = 64, system_len: int = 1024,
                  num_conversations: int = 256, num_turns: int = 4, user_len: int = 64, answer_len: int = 128,
                  output_len: int = 128, conversation_rate: float = 4.0, turn_gap_s: float = 10.0,
                  popularity: float = 1.0) -> list[BenchRequest]:
    """Many system prompts, many multi-turn conversations: the traffic where routing by
    cached prefix pays. Conversations start as a Poisson process at `conversation_rate`
    per second; each picks a system prompt, the k-th most popular with probability
    proportional to 1 / k**popularity (0: uniform); turn t's prompt is turn t-1's plus an
    answer and a new user message, arriving an exponential gap of mean `turn_gap_s` later
    (the user reading and typing). A replica that served turn t-1 holds its prompt's K/V;
    any replica that served the system prompt holds that much."""
    if num_system_prompts < 1 or num_conversations < 0 or num_turns < 1:
        raise ConfigError("conversations needs num_system_prompts >= 1, num_conversations >= 0, num_turns >= 1")
    if conversation_rate <= 0 or turn_gap_s < 0:
        raise ConfigError(f"conversations needs conversation_rate > 0 and turn_gap_s >= 0, "
                          f"got {conversation_rate} and {turn_gap_s}")
    systems = [_tokens(rng, vocab_size, system_len) for _ in range(num_system_prompts)]
    weights = [1.0 / (rank + 1) ** popularity for rank in range(num_system_prompts)]
    out = []
    start = 0.0
    for _ in range(num_conversations):
        start += rng.expovariate(conversation_rate)
        history = list(rng.choices(systems, weights)[0])
        when = start
        for turn in range(num_turns):
            if turn:
                history += _tokens(rng, vocab_size, answer_len)
                when += rng.expovariate(1.0 / turn_gap_s) if turn_gap_s else 0.0
            history += _tokens(rng, vocab_size, user_len)
            out.append(BenchRequest(list(history), output_len, arrival_time=round(when, 6)))
    return sorted(out, key=lambda r: r.arrival_time)


def repetitive(rng: random.Random, vocab_size: int, passage_len: int = 200, num_requests: int = 16,
               output_len: int = 64) -> list[BenchRequest]:
    """Continue or rewrite a passage: the prompt holds the passage and the start of a copy."""
    out = []
    for _ in range(num_requests):
        passage = _tokens(rng, vocab_size, passage_len)
        restart = rng.randrange(1, max(2, passage_len // 4))
        out.append(BenchRequest(passage + passage[:restart], output_len))
    return out


def long_burst(rng: random.Random, vocab_size: int, num_long: int = 4, long_len: int = 2000,
               num_short: int = 32, short_len: int = 64, output_len: int = 64) -> list[BenchRequest]:
    """Short interactive requests with a few very long prompts among them."""
    out = [BenchRequest(_tokens(rng, vocab_size, short_len), output_len) for _ in range(num_short)]
    for i in range(num_long):
        out.insert((i + 1) * len(out) // (num_long + 1), BenchRequest(_tokens(rng, vocab_size, long_len), output_len))
    return out


GENERATORS: dict[str, Callable[..., list[BenchRequest]]] = {
    "skewed": skewed,
    "fixed": fixed,
    "shared-prefix": shared_prefix,
    "multi-turn": multi_turn,
    "conversations": conversations,
    "repetitive": repetitive,
    "long-burst": long_burst,
}


def with_arrivals(requests: list[BenchRequest], rng: random.Random, arrival: str, rate: float,
                  burst_size: int = 8) -> list[BenchRequest]:
    """Offline (all at 0), Poisson at `rate` req/s, or bursts of `burst_size` at `rate` req/s."""
    if arrival == "offline":
        return requests
    if rate <= 0:
        raise ConfigError(f"workload rate must be > 0 for {arrival} arrivals, got {rate}")
    now = 0.0
    out = []
    for index, request in enumerate(requests):
        if arrival == "poisson":
            now += rng.expovariate(rate)
        elif arrival == "bursty":
            if index % burst_size == 0:
                now += rng.expovariate(rate / burst_size)
        else:
            raise ConfigError(f"unknown arrival process {arrival!r}; choose offline, poisson or bursty")
        out.append(attrs.evolve(request, arrival_time=round(now, 6)))
    return out


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    name, _, rest = spec.partition(":")
    if name == "file":
        return name, {"path": rest}
    if name in TRACE_FORMATS:  # PATH,options: read by servelab.traces
        return name, {"rest": rest}
    options: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"workload option {item!r} must be key=value")
        options[key.strip()] = option_value(value.strip())
    return name, options


def build_workload(spec: str, vocab_size: int) -> Workload:
    """Generate (or load) the workload a spec string names; same spec, same requests."""
    name, options = parse_spec(spec)
    if name == "file":
        return Workload.load(options["path"])
    if name in TRACE_FORMATS:
        traced, deadlines, seed = trace_requests(name, options["rest"], lambda rng, n: _tokens(rng, vocab_size, n))
        requests = [BenchRequest(r.prompt_token_ids, r.max_tokens, r.arrival_time) for r in traced]
        return Workload(spec, tuple(deadlines.apply(requests, seed)))
    if name not in GENERATORS:
        raise ConfigError(f"unknown workload {name!r}; choose {', '.join(GENERATORS)}, file:PATH, mooncake:PATH "
                          "or azure:PATH")
    seed = int(options.pop("seed", 0))
    arrival = str(options.pop("arrival", "offline"))
    rate = float(options.pop("rate", 0))
    burst_size = int(options.pop("burst_size", 8))
    structured_fraction = float(options.pop("structured_fraction", 0))
    logprobs = options.pop("logprobs", None)
    adapters = AdapterOptions.pop_from(options)
    deadlines = DeadlineOptions.pop_from(options)
    if not 0 <= structured_fraction <= 1:
        raise ConfigError(f"workload structured_fraction must be in [0, 1], got {structured_fraction}")
    if logprobs is not None and (not isinstance(logprobs, int) or logprobs < 0):
        raise ConfigError(f"workload logprobs must be an integer >= 0, got {logprobs!r}")
    rng = random.Random(seed)
    try:
        requests = GENERATORS[name](rng, vocab_size, **options)
    except TypeError as exc:
        raise ConfigError(f"bad option for workload {name!r}: {exc}") from None
    requests = with_arrivals(requests, rng, arrival, rate, burst_size)
    # Chosen with a generator of their own: the same spec without these options gives the same requests.
    structured = set(random.Random(seed + 1).sample(range(len(requests)), round(structured_fraction * len(requests))))
    if structured or logprobs is not None:
        requests = [attrs.evolve(r, json_schema=i in structured, logprobs=logprobs) for i, r in enumerate(requests)]
    return Workload(spec, tuple(deadlines.apply(adapters.apply(requests, seed), seed)))


@attrs.frozen
class AdapterOptions:
    """Which LoRA adapter each request runs with (`adapters`, `adapter_zipf`, `base_fraction`)."""

    count: int = 0
    zipf: float = 1.0
    base_fraction: float = 0.0

    @classmethod
    def pop_from(cls, options: dict[str, Any]) -> "AdapterOptions":
        count = options.pop("adapters", 0)
        zipf = options.pop("adapter_zipf", 1.0)
        base_fraction = options.pop("base_fraction", 0.0)
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ConfigError(f"workload adapters must be an integer >= 0, got {count!r}")
        if not isinstance(zipf, (int, float)) or zipf < 0:
            raise ConfigError(f"workload adapter_zipf must be a number >= 0, got {zipf!r}")
        if not isinstance(base_fraction, (int, float)) or not 0 <= base_fraction <= 1:
            raise ConfigError(f"workload base_fraction must be in [0, 1], got {base_fraction!r}")
        if count == 0 and (zipf != 1.0 or base_fraction):
            raise ConfigError("workload adapter_zipf and base_fraction need adapters=N")
        return cls(count, float(zipf), float(base_fraction))

    def apply(self, requests: list[BenchRequest], seed: int) -> list[BenchRequest]:
        """The requests with their adapters, drawn with a generator of their own (the same
        spec without these options gives the same requests)."""
        if not self.count:
            return requests
        rng = random.Random(seed + 2)
        base = set(rng.sample(range(len(requests)), round(self.base_fraction * len(requests))))
        weights = [1.0 / (k + 1) ** self.zipf for k in range(self.count)]
        chosen = rng.choices(range(self.count), weights=weights, k=len(requests))
        return [attrs.evolve(r, adapter=None if i in base else chosen[i]) for i, r in enumerate(requests)]

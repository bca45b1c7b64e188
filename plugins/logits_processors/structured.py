"""Structured output through xgrammar: JSON schema, any JSON object, regex, EBNF.

A request's grammar is compiled against the tokenizer before the request reaches the
step loop (`prepare`, awaited by the server's intake; the engine's own call then finds
it cached). Compilation runs in a process of its own (grammar_worker.py), one grammar
at a time, within a time budget (`compile_timeout_s`: past it the request is refused,
and the compiler killed and restarted), and it is cancelled (killed) when the last
request waiting for it goes away. A compiler that dies (killed, a crash) while it
compiles fails that grammar's requests as the server's fault (a 500 naming its exit,
the grammar not remembered as refused); one that died while idle is replaced before the
next grammar, which never sees it. At most `max_pending_compiles` distinct grammars wait
or compile at once (beyond: OverloadedError, a 429), so structured requests cannot pile
up behind one; plain requests never wait for the compiler at all. Compiled grammars are
cached (at most `cache_size` of them and `cache_bytes` bytes, least recently used
first), grammars that failed too (a repeat is refused at once), and concurrent requests
with one schema share one compilation. Each request's state is an xgrammar
GrammarMatcher; every step its next-token bitmask is applied to its logits row (a
batched bitmask for all structured rows of the step). A row the grammar leaves no token
(a state no token of the vocabulary can continue, though the grammar has not ended)
fails its request, `finish_reason="error"` with "structured output: the grammar allows no
next token", instead of sampling a token the grammar forbids; fields that could cause
that (min_tokens, bad_words) are refused with a grammar at admission.

Speculative decoding accepts drafts tentatively: a draft the grammar forbids was masked
out of the row that verifies it (so verification rejects it), and the rows after it are
never used. The state counts such tokens as "dead" so rollback stays exact.
"""

from __future__ import annotations

import collections
import os
import select
import subprocess
import sys
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import Future
from typing import Any, Sequence as Seq

import attrs
import torch

from servelab.errors import OverloadedError, RequestError, exit_status
from servelab.plugins.logits_processors import grammar_worker
from servelab.plugins.logits_processors.options import NO_NEXT_TOKEN, StructuredOptions

_WHAT = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex", "grammar": "grammar"}


def _xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise RequestError("structured output needs xgrammar: pip install 'servelab[structured]'") from None
    return xgrammar


@attrs.define
class GrammarState:
    matcher: Any  # xgrammar.GrammarMatcher
    dead: int = 0  # tokens accepted after one the grammar refused (a rejected draft and those after it)


@attrs.define(eq=False)
class _Job:
    key: tuple[str, str]
    result: Future = attrs.field(factory=Future)  # the CompiledGrammar
    waiters: int = 0
    started: bool = False
    bounded: bool = True  # counts among max_pending_compiles (the warm-up does not)
    cancelled: threading.Event = attrs.field(factory=threading.Event)


@attrs.define(eq=False)
class _Waiter:
    job: _Job
    released: bool = False


class _Cancelled(Exception):
    pass


class _StartTimeout(Exception):
    pass


class CompilerDied(RuntimeError):
    """The compiler process ended while it had a grammar (killed, out of memory, a crash)."""


def _wait(deadline: float) -> float:
    """How long one select() may wait for the worker: a twentieth of a second at most, never past `deadline`."""
    return max(0.0, min(deadline - time.monotonic(), 0.05))


# Specs up to this size are parsed at admission, on the caller's thread (fast at this size,
# so an invalid one is refused before anything is queued); larger ones only by the
# compiler process, inside the compile budget (xgrammar's parse grows with the cube of a
# schema's nesting: 400 levels in 16 KB take seconds).
PARSE_AT_ADMISSION_CHARS = 4096
START_TIMEOUT_S = 120.0  # the compiler process's start-up (importing xgrammar), outside any grammar's budget


class GrammarDeadEnd(RuntimeError):
    """A sequence's grammar allows no next token (and it has not ended): its request fails."""


class CompilerProcess:
    """The grammar worker process: started on first use, killed to cancel or time out."""

    def __init__(self, tokenizer_info_json: str) -> None:
        self._info = tokenizer_info_json
        self._process: subprocess.Popen | None = None
        self._received = bytearray()  # the worker's replies as read so far
        self._cpu_at_start: float | None = None  # the worker's CPU time when it got the current spec
        self.stalled = False  # the last timeout: the worker spent under a tenth of the budget on the CPU

    def compile(self, kind: str, spec: str, timeout: float, cancelled: threading.Event) -> tuple[str, str]:
        """("ok", serialized grammar) or ("error", message); TimeoutError / _Cancelled kill the
        process, CompilerDied says it died while it compiled. The budget starts once the
        process is ready: its start-up (importing xgrammar, reading the vocabulary) is not
        the grammar's. A worker that died before it took the spec (killed while idle, its
        death seen only now) is replaced, and the new one gets the spec and a whole budget."""
        for attempt in range(2):
            self._start(cancelled)
            deadline = time.monotonic() + timeout  # the spec's delivery is inside the budget too
            self.stalled = True  # until the worker has the spec
            try:
                self._send(grammar_worker.encode_message((kind, spec)), deadline, cancelled)
                self._reply(deadline, cancelled, TimeoutError)  # ("compiling", None): it took the spec
            except CompilerDied:
                if attempt:
                    raise
                continue
            self._cpu_at_start = self._cpu_seconds()
            try:
                return self._reply(deadline, cancelled, TimeoutError, timeout)
            finally:
                self._cpu_at_start = None
        raise AssertionError("unreachable")

    def _cpu_seconds(self) -> float | None:
        """The worker's CPU time so far (Linux /proc), None where unknown."""
        try:
            with open(f"/proc/{self._process.pid}/stat") as handle:
                fields = handle.read().rpartition(")")[2].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError, AttributeError):
            return None

    def _send(self, data: bytes, deadline: float, cancelled: threading.Event,
              late: type[Exception] = TimeoutError) -> None:
        """Write `data` to the worker without blocking past `deadline`: a worker that does
        not read (stopped, stuck) cannot hold the dispatcher on a full pipe."""
        fd = self._process.stdin.fileno()
        os.set_blocking(fd, False)
        view = memoryview(data)
        while view:
            self._check(deadline, cancelled, late)
            _, ready, _ = select.select([], [fd], [], _wait(deadline))
            if ready:
                try:
                    view = view[os.write(fd, view):]
                except BlockingIOError:
                    pass
                except BrokenPipeError:
                    raise self._died() from None

    def _reply(self, deadline: float, cancelled: threading.Event, late: type[Exception],
               budget: float | None = None) -> Any:
        """The worker's next message, read as it comes without blocking past `deadline`: a
        worker stopped halfway through a reply (a compiled grammar is megabytes) cannot
        hold the dispatcher either. Bytes of a message after it wait in `_received`."""
        fd = self._process.stdout.fileno()
        os.set_blocking(fd, False)
        while (message := grammar_worker.take_message(self._received)) is None:
            self._check(deadline, cancelled, late, budget)
            ready, _, _ = select.select([fd], [], [], _wait(deadline))
            if ready:
                try:
                    chunk = os.read(fd, 1 << 20)
                except BlockingIOError:
                    continue
                if not chunk:
                    raise self._died()
                self._received += chunk
        return message

    def _check(self, deadline: float, cancelled: threading.Event, late: type[Exception],
               budget: float | None = None) -> None:
        """Kill the worker and raise once the grammar is cancelled or `deadline` has passed."""
        if cancelled.is_set():
            self.kill()
            raise _Cancelled()
        if time.monotonic() < deadline:
            return
        if budget is not None:
            # A worker stopped or starved of CPU is the server's fault, not the grammar's; so is
            # one stopped while it sent its answer (part of it here: the grammar compiled).
            now, start = self._cpu_seconds(), self._cpu_at_start
            self.stalled = bool(self._received) or (now is not None and start is not None
                                                    and now - start < budget / 10)
        self.kill()
        raise late()

    def _start(self, cancelled: threading.Event) -> None:
        if self._process is not None and self._process.poll() is None:
            return
        bootstrap = ("import os, sys; sys.path[:] = [p for p in sys.path if p not in ('', '.', os.getcwd())]; "
                     "from servelab.plugins.logits_processors.grammar_worker import main; main()")
        self._process = subprocess.Popen([sys.executable, "-c", bootstrap], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd="/",
                                         env={**os.environ, "OMP_NUM_THREADS": "1"})
        self._received = bytearray()
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            self._send(grammar_worker.encode_message(self._info), deadline, cancelled, _StartTimeout)
            self._reply(deadline, cancelled, _StartTimeout)  # ("ready", None)
        except _StartTimeout:
            raise RuntimeError(f"the grammar compiler process did not start within {START_TIMEOUT_S:g} s") from None

    def _died(self) -> CompilerDied:
        """The worker closed its pipe (killed, crashed): its exit status; the next grammar starts a new one."""
        process = self._process
        try:
            process.wait(timeout=1.0)  # a closed pipe: it is exiting, or has
        except subprocess.TimeoutExpired:
            pass
        status = exit_status(process.returncode)
        self.kill()
        return CompilerDied(f"the grammar compiler process died ({status})")

    def kill(self) -> None:
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()
        if process is not None:
            for stream in (process.stdin, process.stdout):
                try:
                    stream.close()
                except OSError:
                    pass


class StructuredOutputProcessor:
    def __init__(self, options: StructuredOptions | None, context: Any) -> None:
        self.options = options or StructuredOptions()
        self.vocab_size = context.vocab_size
        self.tokenizer = context.tokenizer
        self.eos_token_ids = sorted(context.eos_token_ids)
        self._tokenizer_info = None
        self._lock = threading.Condition()
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()  # key -> CompiledGrammar
        self._cache_bytes = 0
        self._refused: OrderedDict[tuple[str, str], RequestError] = OrderedDict()  # key -> why (bounded)
        self._valid: OrderedDict[tuple[str, str], None] = OrderedDict()  # specs that parsed (bounded)
        self._jobs: dict[tuple[str, str], _Job] = {}  # waiting or compiling
        self._queue: collections.deque[_Job] = collections.deque()
        self._dispatcher: threading.Thread | None = None
        self._compiler: CompilerProcess | None = None
        self._closed = False
        self._bitmask: torch.Tensor | None = None

    def is_requested(self, params: Any) -> bool:
        return params.structured is not None

    def warm_up(self) -> None:
        """Import xgrammar and compile the JSON-object grammar now (a server calls this on a
        thread at start, so the first structured request waits for neither)."""
        try:
            _xgrammar()
            if self.tokenizer is not None:
                from servelab import StructuredOutput

                self._ticket(_Params(StructuredOutput.json_object()), bounded=False).result(timeout=START_TIMEOUT_S)
        except Exception:  # no xgrammar, or no tokenizer: the first structured request says so
            pass

    # ------------------------------------------------------------ admission

    def validate(self, params: Any) -> None:
        """Refuse what cannot work before the request is queued: no tokenizer, no xgrammar,
        ignore_eos (the grammar ends the output with EOS), fields that can leave the grammar
        no token, or a spec xgrammar cannot parse (one of up to PARSE_AT_ADMISSION_CHARS)."""
        structured = params.structured
        if structured is None:
            raise RequestError("logits_processors names 'structured', which takes its grammar from the structured "
                               "field (the server's response_format or guided_*): give that instead")
        if self.tokenizer is None:
            raise RequestError("structured output needs a tokenizer; this checkpoint has none")
        if params.ignore_eos:
            raise RequestError("structured output ends the output with EOS; it cannot be combined with ignore_eos")
        if params.min_tokens:
            raise RequestError("min_tokens cannot be combined with structured output: it bans the end of the "
                               "output, which the grammar may need sooner")
        if params.bad_words:
            raise RequestError("bad_words cannot be combined with structured output: they can ban the only "
                               "tokens the grammar allows")
        xgr = _xgrammar()
        key = (structured.kind, structured.spec)
        with self._lock:
            if key in self._refused:
                raise self._refused[key]
            if key in self._cache or key in self._valid or key in self._jobs:
                return
        if len(structured.spec) > PARSE_AT_ADMISSION_CHARS:
            return  # parsing may take long: the compiler checks it, within compile_timeout_s
        try:
            if structured.kind == "json":
                xgr.Grammar.from_json_schema(structured.spec, any_whitespace=False)
            elif structured.kind == "regex":
                xgr.Grammar.from_regex(structured.spec)
            elif structured.kind == "grammar":
                xgr.Grammar.from_ebnf(structured.spec)
        except Exception as exc:
            raise RequestError(f"structured output {_WHAT[structured.kind]} is invalid: "
                               f"{grammar_worker.first_line(exc)}") from None
        with self._lock:
            self._valid[key] = None
            while len(self._valid) > 4 * self.options.cache_size:
                self._valid.popitem(last=False)

    def prepare(self, params: Any) -> Future:
        """The compiled grammar, as a Future of this request's own: cancelling it (or dropping
        it) leaves the compilation, which is cancelled once no request waits for it."""
        return self._ticket(params, bounded=True)

    def _ticket(self, params: Any, bounded: bool) -> Future:
        """prepare's Future; `bounded` False for the server's own warm-up, which takes no
        client's place among max_pending_compiles."""
        structured = params.structured
        key = (structured.kind, structured.spec)
        ticket: Future = Future()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                ticket.set_result(self._cache[key])
                return ticket
            if key in self._refused:
                ticket.set_exception(self._refused[key])
                return ticket
            job = self._jobs.get(key)
            if job is None:
                pending = sum(job.bounded for job in self._jobs.values())
                if bounded and pending >= self.options.max_pending_compiles:
                    raise OverloadedError(f"structured output: {pending} grammars are compiling or waiting "
                                          f"to (max_pending_compiles = {self.options.max_pending_compiles}); "
                                          f"retry later")
                job = self._jobs[key] = _Job(key, bounded=bounded)
                self._queue.append(job)
                self._start_dispatcher()
                self._lock.notify_all()
            job.waiters += 1
        waiter = _Waiter(job)
        weakref.finalize(ticket, self._release, waiter)  # a dropped ticket leaves too

        def settle(result: Future) -> None:
            if ticket.done():
                return
            if result.cancelled():
                ticket.cancel()
            elif result.exception() is not None:
                ticket.set_exception(result.exception())
            else:
                ticket.set_result(result.result())

        def on_ticket_done(done: Future) -> None:
            if done.cancelled():
                self._release(waiter)

        ticket.add_done_callback(on_ticket_done)
        job.result.add_done_callback(settle)
        return ticket

    def _release(self, waiter: _Waiter) -> None:
        with self._lock:
            if waiter.released:
                return
            waiter.released = True
            job = waiter.job
            job.waiters -= 1
            if job.waiters > 0 or job.result.done():
                return
            if self._jobs.get(job.key) is job:
                del self._jobs[job.key]
            if job.started:
                job.cancelled.set()  # the dispatcher kills the compiler
            else:
                self._queue.remove(job)
                job.result.cancel()

    def _start_dispatcher(self) -> None:
        if self._dispatcher is None:
            self._dispatcher = threading.Thread(target=self._dispatch, name="servelab-grammar", daemon=True)
            self._dispatcher.start()

    def _dispatch(self) -> None:
        while True:
            with self._lock:
                while not self._queue:
                    self._lock.wait()
                job = self._queue.popleft()
                job.started = True
            self._run(job)

    def _run(self, job: _Job) -> None:
        kind, spec = job.key
        timeout = self.options.compile_timeout_s
        try:
            compiler = self._compiler_process()
            status, value = compiler.compile(kind, spec, timeout, job.cancelled)
            if status == "ok":
                compiled = _xgrammar().CompiledGrammar.deserialize_json(value, self._info())
                self._check_not_empty(kind, compiled)
                self._finish(job, compiled)
            else:
                self._finish(job, RequestError(f"structured output {_WHAT[kind]} is invalid: {value}"))
        except _Cancelled:
            job.result.cancel()
        except TimeoutError:
            if compiler.stalled:  # ours: the worker did not work on it; not remembered
                with self._lock:
                    self._jobs.pop(job.key, None)
                job.result.set_exception(RuntimeError(
                    f"the grammar compiler stalled: the {_WHAT[kind]} got under a tenth of its {timeout:g} s "
                    f"budget of CPU time; the compiler was restarted, retry"))
                return
            self._finish(job, RequestError(f"structured output {_WHAT[kind]} did not compile within {timeout:g} s "
                                           f"(compile_timeout_s): simplify it"))
        except RequestError as exc:
            self._finish(job, exc)
        except CompilerDied as exc:  # ours, not the grammar's: not remembered
            with self._lock:
                self._jobs.pop(job.key, None)
            job.result.set_exception(RuntimeError(f"{exc} while it compiled the {_WHAT[kind]}; the next grammar "
                                                  f"gets a new compiler: retry"))
        except Exception as exc:  # ours, not the client's: not remembered as the grammar's fault
            with self._lock:
                self._jobs.pop(job.key, None)
            job.result.set_exception(RuntimeError(f"compiling the grammar failed: {type(exc).__name__}: {exc}"))

    @staticmethod
    def _check_not_empty(kind: str, compiled: Any) -> None:
        """A grammar without a single sentence (a regex matching nothing, an EBNF whose root
        never ends) leaves the first token nothing to choose: refused, not sampled anyway."""
        xgr = _xgrammar()
        matcher = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
        matcher.fill_next_token_bitmask(bitmask, 0)
        if not bool(bitmask.any()):
            raise RequestError(f"structured output {_WHAT[kind]} allows no output at all")

    def _finish(self, job: _Job, outcome: Any) -> None:
        with self._lock:
            if self._jobs.get(job.key) is job:
                del self._jobs[job.key]
            if isinstance(outcome, RequestError):
                self._refused[job.key] = outcome
                while len(self._refused) > self.options.cache_size:
                    self._refused.popitem(last=False)
            else:
                self._cache[job.key] = outcome
                self._cache_bytes += _size(outcome)
                while len(self._cache) > 1 and (len(self._cache) > self.options.cache_size
                                                or self._cache_bytes > self.options.cache_bytes):
                    _, evicted = self._cache.popitem(last=False)
                    self._cache_bytes -= _size(evicted)
        if isinstance(outcome, RequestError):
            job.result.set_exception(outcome)
        else:
            job.result.set_result(outcome)

    def _info(self) -> Any:
        if self._tokenizer_info is None:
            xgr = _xgrammar()
            backend = self.tokenizer.backend
            vocab = backend.get_vocab(with_added_tokens=True)
            encoded = [""] * self.vocab_size
            for token, token_id in vocab.items():
                if token_id < self.vocab_size:
                    encoded[token_id] = token
            metadata = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
            self._tokenizer_info = xgr.TokenizerInfo(encoded, metadata["vocab_type"], vocab_size=self.vocab_size,
                                                     stop_token_ids=self.eos_token_ids or None,
                                                     add_prefix_space=metadata["add_prefix_space"])
        return self._tokenizer_info

    def _compiler_process(self) -> CompilerProcess:
        if self._compiler is None:
            self._compiler = CompilerProcess(self._info().serialize_json())
            weakref.finalize(self, self._compiler.kill)
        return self._compiler

    def close(self) -> None:
        if self._compiler is not None:
            self._compiler.kill()

    def new_state(self, request: Any) -> GrammarState:
        return GrammarState(_xgrammar().GrammarMatcher(request.prepared))

    def release(self, state: GrammarState) -> None:
        state.matcher = None

    # ------------------------------------------------------------ per step

    def apply(self, logits: torch.Tensor, states: Seq[GrammarState]) -> torch.Tensor:
        with torch.inference_mode():  # the bitmask buffer may have been made inside inference mode
            return self._apply(logits, states)

    def _apply(self, logits: torch.Tensor, states: Seq[GrammarState]) -> torch.Tensor:
        xgr = _xgrammar()
        rows = len(states)
        if self._bitmask is None or self._bitmask.shape[0] < rows:
            self._bitmask = xgr.allocate_token_bitmask(max(rows, 64), self.vocab_size)
        bitmask = self._bitmask[:rows]
        bitmask.fill_(-1)  # all allowed: rows no token of the request can follow stay unmasked
        live = []
        for row, state in enumerate(states):
            # After a refused token or EOS (a tentatively accepted draft) the row is never used.
            # A grammar in an accepting state allows its stop tokens: its row is not empty.
            if not state.dead and not state.matcher.is_terminated():
                state.matcher.fill_next_token_bitmask(bitmask, row)
                live.append(row)
        if live and not bool(bitmask[live].any(dim=1).all()):
            # A row the grammar left no token (no token spells what the grammar needs next):
            # sampling it anyway would break the constraint. The pipeline retries row by row,
            # so this fails only the requests of the empty rows.
            raise GrammarDeadEnd(f"structured output: {NO_NEXT_TOKEN}")
        logits = logits.contiguous()
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size)
        return logits

    def accept(self, state: GrammarState, token_id: int) -> None:
        if state.dead:
            state.dead += 1
        elif not state.matcher.accept_token(token_id):
            state.dead = 1

    def rollback(self, state: GrammarState, num_tokens: int) -> None:
        dead = min(state.dead, num_tokens)
        state.dead -= dead
        if num_tokens > dead:
            state.matcher.rollback(num_tokens - dead)


@attrs.frozen
class _Params:
    structured: Any


def _size(compiled: Any) -> int:
    try:
        return int(compiled.memory_size_bytes)
    except Exception:
        return 0

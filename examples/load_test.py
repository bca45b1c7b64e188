"""Load-test `servelab serve` from one process over loopback and print the figures:
requests, concurrency, outcomes by kind, client-side TTFT / TPOT p50 / p99, and the KV
blocks still in use once the server is idle (leaked blocks).

    python examples/load_test.py --model builtin:tiny-random --requests 1000 --concurrency 300
    python examples/load_test.py --url http://127.0.0.1:8000 --requests 500   # a running server

Without --url it starts `servelab serve --port 0` itself (engine settings via --set),
runs the load, then stops the server with SIGTERM and reports its exit code and its
last log line (which counts the KV blocks still held: 0). With --disconnect N the first N
clients hang up halfway through their stream; with --sigterm-after S the server gets
SIGTERM S seconds into the run, so the report shows what a shutdown under load does:
requests completed, refused (503 while draining, or no connection once it closed),
aborted at the drain deadline (finish_reason "abort" and [DONE]) and disconnected.
Every request is a streaming completion with ignore_eos, so an answered request must
bring exactly --max-tokens tokens; anything else counts as "incomplete".
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from servelab.server.loadgen import run_load


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running server (default: start one)")
    parser.add_argument("--model", default="builtin:tiny-random")
    parser.add_argument("--set", dest="assignments", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--max-waiting", type=int, default=256, help="the started server's queue limit")
    parser.add_argument("--api-key")
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--concurrency", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--prompt-words", default="4,24", help="min,max words per random prompt")
    parser.add_argument("--vocab", default="3,211", help="prompt words are w<i> for i in [lo, hi)")
    parser.add_argument("--disconnect", type=int, default=0, help="this many clients hang up halfway")
    parser.add_argument("--sigterm-after", type=float, help="SIGTERM the started server this many seconds in")
    parser.add_argument("--shutdown-timeout", type=float, default=10.0, help="the started server's drain deadline")
    parser.add_argument("--replicas", type=int, help="the started server runs this many engine replicas on Ray")
    args = parser.parse_args()

    server = None if args.url else start_server(args)
    url = args.url or server[1]
    low, high = (int(x) for x in args.prompt_words.split(","))
    vocab = tuple(int(x) for x in args.vocab.split(","))
    if server and args.sigterm_after is not None:
        def sigterm() -> None:
            server[0].signalled = True
            server[0].send_signal(signal.SIGTERM)

        threading.Timer(args.sigterm_after, sigterm).start()
    try:
        report = asyncio.run(run_load(url, args.requests, args.concurrency, args.max_tokens, (low, high),
                                      api_key=args.api_key, vocab=vocab, timeout=600,
                                      num_disconnect=args.disconnect))
    finally:
        code = stop_server(server[0]) if server else None
    print(report.format())
    if code is not None:
        print(f"server exit code after SIGTERM: {code}")
        print(f"server's last words: {server[2].read_text().strip().splitlines()[-1]}")
    return 0


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str, Path]:
    command = [sys.executable, "-m", "servelab.cli", "-v", "serve", "--model", args.model, "--port", "0",
               "--max-waiting", str(args.max_waiting),
               "--shutdown-timeout", str(getattr(args, "shutdown_timeout", 10.0))]
    if getattr(args, "replicas", None):
        command += ["--replicas", str(args.replicas)]
    if getattr(args, "engine_threads", None):
        command += ["--engine-threads", str(args.engine_threads)]
    for assignment in args.assignments:
        command += ["--set", assignment]
    if args.api_key:
        command += ["--api-key", args.api_key]
    log = Path(tempfile.mkdtemp(prefix="servelab-load-")) / "server.log"
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log.open("w"), text=True)
    line = process.stdout.readline()
    if "on http://" not in line:
        process.kill()
        raise SystemExit(f"the server did not start: {line!r}")
    threading.Thread(target=process.stdout.read, daemon=True).start()  # keep its stdout drained
    url = line.rsplit(" ", 1)[-1].strip()
    print(f"started {' '.join(command)} -> {url} (log: {log})", file=sys.stderr)
    return process, url, log


def stop_server(process: subprocess.Popen) -> int:
    if process.poll() is None and not getattr(process, "signalled", False):
        process.send_signal(signal.SIGTERM)
    try:
        return process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


if __name__ == "__main__":
    sys.exit(main())

"""`servelab serve`'s command-line options -> ServerOptions.

The API key comes from `--api-key`, `--api-key-file PATH` (the file's first line) or the
SERVELAB_API_KEY environment variable, in that order, so it never has to appear on a
command line (where `ps` shows it). An empty key is refused wherever it comes from:
it would otherwise turn authentication off without a word.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Mapping

from servelab.config import DTYPES
from servelab.errors import ServelabError
from servelab.server.caps import RequestCaps
from servelab.server.limits import CHARS_PER_TOKEN_BOUND, RequestLimits
from servelab.server.serve import ServerOptions

API_KEY_ENV = "SERVELAB_API_KEY"


def add_serve_arguments(serve: argparse.ArgumentParser) -> None:
    """The HTTP server's own options (the engine's come from --model, --config, --set)."""
    limits = RequestLimits()
    _add_lora_arguments(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    serve.add_argument("--api-key", help=f"require `Authorization: Bearer KEY` on /v1/* (better: --api-key-file "
                                         f"or ${API_KEY_ENV}, which keep it off the command line)")
    serve.add_argument("--api-key-file", help="read the API key from the first line of this file")
    serve.add_argument("--served-model-name", help="the model id clients send (default: the --model value)")
    serve.add_argument("--max-waiting", type=int, default=256,
                       help="queued sequences beyond which requests get 429 with Retry-After (default 256)")
    serve.add_argument("--shutdown-timeout", type=float, default=10.0,
                       help="seconds in-flight requests get to finish on SIGINT/SIGTERM (default 10)")
    serve.add_argument("--header-timeout", type=float, default=10.0,
                       help="seconds a connection gets to send a request's headers, else 408 (default 10)")
    serve.add_argument("--body-timeout", type=float, default=limits.body_timeout,
                       help=f"seconds a request gets to send its body, else 408 (default {limits.body_timeout:g})")
    serve.add_argument("--max-body-bytes", type=int, default=limits.max_body_bytes,
                       help=f"larger request bodies get 413 (default {limits.max_body_bytes})")
    serve.add_argument("--max-json-depth", type=int, default=limits.max_json_depth,
                       help=f"deeper nested JSON bodies get 400 (default {limits.max_json_depth})")
    serve.add_argument("--max-prompt-chars", type=int, default=None,
                       help=f"longer prompts get 400 before tokenization (default {CHARS_PER_TOKEN_BOUND} "
                            f"x max_model_len)")
    serve.add_argument("--limit", action="append", default=[], metavar="NAME=VALUE",
                       help=f"a per-request limit (repeatable; docs/serving.md lists them): "
                            f"{', '.join(RequestCaps.names())}")
    serve.add_argument("--liveness-timeout", type=float, default=30.0,
                       help="/health answers 503 once the engine's loop has not turned for this many seconds "
                            "while requests wait (default 30; at least 1, and 2 with --prefill-replicas)")
    serve.add_argument("--tokenizer-workers", type=int, default=2,
                       help="threads that tokenize prompts and render chat templates (default 2)")
    serve.add_argument("--engine-threads", type=int, default=None,
                       help="torch threads of the engine process (default: every CPU core, as vLLM's; "
                            "fewer where other work shares the machine)")
    serve.add_argument("--dtype", choices=DTYPES, default=None,
                       help="the model's dtype (engine.dtype; default: bfloat16 on a CPU that computes it "
                            "natively, AVX-512 BF16 or AMX, else float32)")
    serve.add_argument("--chat-template", default=None,
                       help="the chat template (a jinja file, or its text) for a checkpoint without one, or "
                            "instead of its own; 'plain' for `role: content` lines (default: the checkpoint's; "
                            "without one chat requests get a 400)")
    serve.add_argument("--trust-request-chat-template", action="store_true",
                       help="render a chat_template sent in a request (a jinja template the client wrote, in "
                            "a sandbox but unbounded in time); without this flag such a request gets a 400")
    serve.add_argument("--stream-interval", type=int, default=1,
                       help="tokens per streamed chunk (default 1: a chunk per token; more: fewer, larger "
                            "chunks, cheaper for the server)")
    serve.add_argument("--replicas", type=int, default=None,
                       help="run N engine replicas as Ray actors behind this server, requests spread by the "
                            "config's [router] (needs the ray extra)")
    serve.add_argument("--ray-address", default=None,
                       help="with --replicas (or --prefill-replicas): the Ray cluster to join (default: start a "
                            "local Ray)")
    serve.add_argument("--prefill-replicas", type=int, default=None,
                       help="prefill/decode disaggregation: run N prefill engines as Ray actors, with "
                            "--decode-replicas M decode engines, the KV handed over by the config's [kv_transfer] "
                            "(default shared-files); docs/disaggregation.md")
    serve.add_argument("--decode-replicas", type=int, default=None,
                       help="with --prefill-replicas: M decode engines as Ray actors")
    serve.add_argument("--kv-failure-policy", choices=("fail", "recompute"), default="recompute",
                       help="with --prefill-replicas: a request whose prefill replica or KV handoff was lost ends "
                            "with an error (fail) or is computed again on a decode replica, counted and logged "
                            "(recompute, the default)")
    serve.add_argument("--kv-lease-s", type=float, default=30.0,
                       help="with --prefill-replicas: seconds a prefill replica holds a request's KV blocks for "
                            "its decode replica (default 30)")


def serve_options(args: argparse.Namespace, environ: Mapping[str, str]) -> ServerOptions:
    """ServerOptions from parsed arguments; ServelabError for a bad value (an empty key included)."""
    limits = RequestLimits(max_body_bytes=args.max_body_bytes, max_json_depth=args.max_json_depth,
                           body_timeout=args.body_timeout, max_prompt_chars=args.max_prompt_chars,
                           caps=RequestCaps().with_settings(args.limit))
    return ServerOptions(host=args.host, port=args.port, api_key=api_key(args, environ),
                         served_model_name=args.served_model_name, max_waiting=args.max_waiting,
                         shutdown_timeout=args.shutdown_timeout, header_timeout=args.header_timeout,
                         limits=limits, tokenizer_workers=args.tokenizer_workers,
                         engine_threads=args.engine_threads, replicas=args.replicas, ray_address=args.ray_address,
                         prefill_replicas=args.prefill_replicas, decode_replicas=args.decode_replicas,
                         kv_failure_policy=args.kv_failure_policy, kv_lease_s=args.kv_lease_s,
                         liveness_timeout=args.liveness_timeout, chat_template=args.chat_template,
                         trust_request_chat_template=args.trust_request_chat_template,
                         stream_interval=args.stream_interval,
                         lora_modules=tuple(_lora_module(text) for text in args.lora_modules or ()),
                         allow_runtime_lora_updating=args.allow_runtime_lora_updating,
                         max_lora_adapters=args.max_lora_adapters, max_lora_bytes=args.max_lora_bytes)


def _add_lora_arguments(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH",
                       help="LoRA adapters (peft's saved directories) served as the models NAME (sets [engine] "
                            "enable_lora); docs/lora.md")
    serve.add_argument("--allow-runtime-lora-updating", action="store_true",
                       help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter")
    serve.add_argument("--max-lora-adapters", type=int, default=64,
                       help="LoRA adapters the server holds at once (default 64)")
    serve.add_argument("--max-lora-bytes", type=int, default=256 * 2**20,
                       help="the largest adapter weights file the server loads, in bytes (default 256 MiB)")


def _lora_module(text: str) -> tuple[str, str]:
    name, separator, path = text.partition("=")
    if not separator or not name or not path:
        raise ServelabError(f"--lora-modules takes NAME=PATH, got {text!r}")
    return name, path


def api_key(args: argparse.Namespace, environ: Mapping[str, str]) -> str | None:
    """The key from --api-key, --api-key-file or the environment; None when none is given."""
    if args.api_key is not None:
        return _non_empty(args.api_key, "--api-key")
    if args.api_key_file is not None:
        try:
            lines = Path(args.api_key_file).read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise ServelabError(f"--api-key-file: cannot read {args.api_key_file!r}: {exc.strerror or exc}") from None
        return _non_empty(lines[0] if lines else "", f"--api-key-file {args.api_key_file!r}")
    if API_KEY_ENV in environ:
        return _non_empty(environ[API_KEY_ENV], API_KEY_ENV)
    return None


def _non_empty(key: str, source: str) -> str:
    key = key.strip()
    if not key:
        raise ServelabError(f"the API key from {source} is empty; an empty key would turn authentication off "
                            f"(leave it unset to serve without a key)")
    return key

"""The LoRA adapters a server serves, by the name clients send as the OpenAI `model`.

`servelab serve --lora-modules name=path ...` registers adapters at start (each read and
checked against the base model first: a bad one stops the start, naming file and field).
With `--allow-runtime-lora-updating`, `POST /v1/load_lora_adapter` ({"lora_name",
"lora_path"}) and `POST /v1/unload_lora_adapter` ({"lora_name"}) change the set at run
time (vLLM's names), within the server's bounds: at most `max_adapters` adapters, each
weights file at most `max_bytes`. A refused adapter changes nothing: the others, and the
requests in flight, are untouched.

Every adapter gets an id of its own (LoRARequest.lora_int_id), never reused: an adapter
unloaded and loaded again under the same name is a new adapter to the engine, so nothing
cached under the old one (KV prefixes, the fast pool) serves the new one.
"""

from __future__ import annotations

import itertools
import threading
from pathlib import Path
from typing import Any

import attrs

from servelab.lora_request import LoRARequest
from servelab.model.lora_adapter import WEIGHTS_FILE, LoRAAdapterError, load_adapter
from servelab.server.protocol import ApiError, bad_request

DEFAULT_MAX_ADAPTERS = 64
DEFAULT_MAX_BYTES = 256 * 2**20


@attrs.frozen
class LoRABounds:
    max_adapters: int = DEFAULT_MAX_ADAPTERS  # adapters registered at once
    max_bytes: int = DEFAULT_MAX_BYTES  # one adapter's weights file
    max_rank: int = 64  # [engine] max_lora_rank


class LoRAModules:
    """name -> LoRARequest, checked against the base model's config."""

    def __init__(self, model_config: Any, bounds: LoRABounds, runtime_updates: bool = False) -> None:
        self.model_config = model_config
        self.bounds = bounds
        self.runtime_updates = runtime_updates
        self._adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def names(self) -> list[LoRARequest]:
        with self._lock:
            return list(self._adapters.values())

    def resolve(self, model: str) -> LoRARequest | None:
        with self._lock:
            return self._adapters.get(model)

    def load(self, name: Any, path: Any) -> LoRARequest:
        """Check and register an adapter; ApiError 400 (nothing changed) when refused."""
        if not isinstance(name, str) or not name.strip():
            raise bad_request("lora_name must be a non-empty string", "lora_name")
        if not isinstance(path, str) or not path:
            raise bad_request("lora_path must be a non-empty string", "lora_path")
        with self._lock:
            if name in self._adapters:
                raise bad_request(f"a LoRA adapter named {name!r} is already loaded; unload it first", "lora_name")
            if len(self._adapters) >= self.bounds.max_adapters:
                raise bad_request(f"this server holds at most {self.bounds.max_adapters} LoRA adapters; unload one "
                                  f"first", "lora_name")
        weights = Path(path) / WEIGHTS_FILE
        if weights.is_file() and weights.stat().st_size > self.bounds.max_bytes:
            raise bad_request(f"{weights}: {weights.stat().st_size} bytes, more than this server's limit of "
                              f"{self.bounds.max_bytes} for one adapter", "lora_path")
        try:
            load_adapter(name, path, self.model_config, self.bounds.max_rank)
        except LoRAAdapterError as exc:
            raise bad_request(f"LoRA adapter {name!r}: {exc}", "lora_path") from None
        with self._lock:
            if name in self._adapters:  # loaded meanwhile by another request
                raise bad_request(f"a LoRA adapter named {name!r} is already loaded; unload it first", "lora_name")
            request = LoRARequest(name, next(self._ids), path)
            self._adapters[name] = request
        return request

    def unload(self, name: Any) -> None:
        with self._lock:
            if not isinstance(name, str) or name not in self._adapters:
                raise ApiError(404, f"no LoRA adapter named {name!r} is loaded", "lora_name", "not_found")
            del self._adapters[name]

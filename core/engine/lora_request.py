"""Which LoRA adapter a request runs with, in vLLM's shape: `LoRARequest(name, id, path)`.

    from servelab import LLM, LoRARequest, SamplingParams
    llm = LLM("builtin:tiny", enable_lora=True)
    llm.generate("The", SamplingParams(max_tokens=8), lora_request=LoRARequest("sql", 1, "/adapters/sql"))

`lora_int_id` (> 0) is the adapter's identity in the engine: prefix-cache entries, the
fast pool and the scheduler's adapter cap key on it; one id names one adapter (the same
name and path) for the engine's whole life.
"""

from __future__ import annotations

import os

import attrs

from servelab.errors import RequestError


@attrs.frozen
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = attrs.field(converter=lambda path: os.fspath(path) if isinstance(path, os.PathLike) else path)

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise RequestError(f"LoRARequest.lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id <= 0:
            raise RequestError(f"LoRARequest.lora_int_id must be an int > 0, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise RequestError(f"LoRARequest.lora_path must be a non-empty string, got {self.lora_path!r}")

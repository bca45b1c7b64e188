"""The offline Python API: `LLM(model).generate(prompts, params)`."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence as Seq

from servelab.arrivals import NOW, Arrival, serve_arrivals
from servelab.config import EngineConfig
from servelab.engine import LLMEngine
from servelab.errors import RequestError
from servelab.lora_request import LoRARequest
from servelab.outputs import RequestOutput
from servelab.registry import PluginRegistry
from servelab.request import RequestSpec
from servelab.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """An engine plus the loop that drives it to completion.

    `model` is a checkpoint directory or "builtin:<name>"; `config` a TOML path, a dict
    or an EngineConfig; keyword overrides are `[engine]` keys (`max_num_seqs=8`) or
    dotted keys for other sections (`**{"scheduler.name": "continuous"}`).
    """

    def __init__(self, model: str | Path | None = None,
                 config: EngineConfig | Mapping[str, Any] | str | Path | None = None,
                 registry: PluginRegistry | None = None, **overrides: Any) -> None:
        engine_config = EngineConfig.load(config)
        if model is not None:
            overrides["engine.model"] = str(model)
        if overrides:
            engine_config = engine_config.with_overrides(overrides)
        self.engine = LLMEngine(engine_config, registry)

    def close(self) -> None:
        """Shut down the engine's other ranks (tensor parallelism); a no-op otherwise."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Seq[Prompt],
                 params: SamplingParams | Seq[SamplingParams] | None = None,
                 priority: int | Seq[int] = 0,
                 lora_request: LoRARequest | Seq[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion, all queued together; outputs in prompt order.

        `priority` (one for all, or one per prompt; lower runs first) orders admission
        under the continuous and chunked-prefill schedulers when not all fit at once.
        `lora_request` (one for all, or one per prompt, None for the base model) names the
        LoRA adapter each prompt runs with (the engine needs `enable_lora`; docs/lora.md).
        """
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_params_list(params, len(prompt_list))
        priorities = _as_priority_list(priority, len(prompt_list))
        adapters = _as_lora_list(lora_request, len(prompt_list))
        # every prompt is checked (once) before any is queued
        records = self.engine.prepare_requests([RequestSpec(p, sp, priority=rank, lora_request=adapter)
                                                for p, sp, rank, adapter
                                                in zip(prompt_list, params_list, priorities, adapters)])
        outputs: dict[int, RequestOutput] = {}
        admitted: dict[int, str] = {}

        def admit(arrival: Arrival[int]) -> tuple[int, str]:
            i = arrival.item
            admitted[i] = self.engine.admit([records[i]])[0]
            return 0, admitted[i]

        def finished(arrival: Arrival[int], _engine: int, output: RequestOutput) -> None:
            outputs[arrival.item] = output

        try:
            serve_arrivals([self.engine], [Arrival(NOW, i) for i in range(len(prompt_list))], admit, finished)
        except BaseException:
            for i, request_id in admitted.items():
                if i not in outputs:
                    self.engine.abort(request_id)
            self.engine.discard([record for i, record in enumerate(records) if i not in admitted])
            raise
        return [outputs[i] for i in range(len(prompt_list))]


def _as_prompt_list(prompts: Any) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]
    if isinstance(prompts, (list, tuple)):
        if not prompts:
            raise RequestError("no prompts given")
        return list(prompts)
    raise RequestError(f"prompts must be a string, a list of token ids, or a list of those; got {type(prompts).__name__}")


def _as_params_list(params: Any, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    if not isinstance(params, (list, tuple)):
        raise RequestError(f"params must be SamplingParams or a list of them, got {type(params).__name__}")
    params = list(params)
    if len(params) != count:
        raise RequestError(f"got {len(params)} SamplingParams for {count} prompts; give one, or one per prompt")
    for p in params:
        if not isinstance(p, SamplingParams):
            raise RequestError(f"params must be SamplingParams, got {type(p).__name__}")
    return params


def _as_priority_list(priority: Any, count: int) -> list[int]:
    if not isinstance(priority, (int, list, tuple)) or isinstance(priority, bool):
        raise RequestError(f"priority must be an int or a list of ints, got {type(priority).__name__}")
    values = [priority] * count if isinstance(priority, int) else list(priority)
    if len(values) != count:
        raise RequestError(f"got {len(values)} priorities for {count} prompts; give one, or one per prompt")
    for value in values:
        if not isinstance(value, int) or isinstance(value, bool):
            raise RequestError(f"priority must be an int, got {value!r}")
    return values


def _as_lora_list(lora_request: Any, count: int) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * count
    if not isinstance(lora_request, (list, tuple)):
        raise RequestError(f"lora_request must be a LoRARequest or a list of them, got {type(lora_request).__name__}")
    if len(lora_request) != count:
        raise RequestError(f"got {len(lora_request)} lora_requests for {count} prompts; give one, or one per prompt")
    for value in lora_request:
        if value is not None and not isinstance(value, LoRARequest):
            raise RequestError(f"lora_request must be a LoRARequest or None, got {type(value).__name__}")
    return list(lora_request)

"""servelab: an LLM serving engine whose every policy is a plugin.

    from servelab import LLM, SamplingParams
    llm = LLM("builtin:tiny")
    print(llm.generate("The", SamplingParams(max_tokens=8, temperature=0))[0].text)

Importing `servelab` stays light (no torch) so plugin discovery is cheap; `LLM` and
`LLMEngine` load the heavy modules on first use.
"""

from servelab.config import EngineConfig
from servelab.errors import CheckpointError, ConfigError, DistributedError, PluginError, RequestError, ServelabError
from servelab.hookspecs import hookimpl
from servelab.logging_setup import get_logger
from servelab.lora_request import LoRARequest
from servelab.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, StepReport
from servelab.plugin_types import (AllocatorPlugin, AttentionPlugin, DrafterPlugin, EvictionPlugin,
                                   LogitsProcessorPlugin, RouterPlugin, SchedulerPlugin, VictimPlugin)
from servelab.plugin_types import AdapterResidencyPlugin
from servelab.plugin_types import KVTransferPlugin
from servelab.registry import PluginRegistry
from servelab.sampling_params import SamplingParams
from servelab.structured import StructuredOutput

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "LLMEngine",
    "LoRARequest",
    "AdapterResidencyPlugin",
    "AllocatorPlugin",
    "AttentionPlugin",
    "CheckpointError",
    "CompletionOutput",
    "ConfigError",
    "DistributedError",
    "DrafterPlugin",
    "EvictionPlugin",
    "Logprob",
    "LogitsProcessorPlugin",
    "EngineConfig",
    "KVTransferPlugin",
    "PluginError",
    "PluginRegistry",
    "RequestError",
    "RequestMetrics",
    "RouterPlugin",
    "RequestOutput",
    "SamplingParams",
    "SchedulerPlugin",
    "ServelabError",
    "StepReport",
    "StructuredOutput",
    "VictimPlugin",
    "get_logger",
    "hookimpl",
]


def __getattr__(name: str):
    if name == "LLM":
        from servelab.llm import LLM

        return LLM
    if name == "LLMEngine":
        from servelab.engine import LLMEngine

        return LLMEngine
    raise AttributeError(f"module 'servelab' has no attribute {name!r}")

"""Tensor and expert parallelism as a plugin of the engine: the runner for [engine]
tensor_parallel_size, expert_parallel_size or
pipeline_parallel_size > 1. The engine asks through
servelab_tensor_parallel_runner and never imports this package; torch.distributed loads
only when a spec arrives."""

from __future__ import annotations

from typing import Any

import servelab


@servelab.hookimpl
def servelab_tensor_parallel_runner(spec: Any) -> Any:
    from servelab.distributed.runner import (ExpertParallelRunner, PipelineParallelRunner, TensorParallelRunner,
                                             start_tensor_parallel)
    from servelab.distributed.shard_runner import ShardSpec

    engine = spec.engine
    experts = engine.expert_parallel_size > 1
    stages = engine.pipeline_parallel_size > 1
    shard = ShardSpec(model_path=str(spec.source.path), engine=engine, attention=spec.attention,
                      attention_options=spec.attention_options, attention_context=spec.attention_context,
                      num_blocks=spec.num_blocks, max_positions=spec.max_positions,
                      size=(engine.expert_parallel_size if experts
                            else engine.pipeline_parallel_size * engine.tensor_parallel_size if stages
                            else engine.tensor_parallel_size),
                      expert_parallel=experts, pipeline_parallel=stages, expert_placement=engine.expert_placement,
                      redundant_experts=engine.redundant_experts,
                      tensor_parallel_size=engine.tensor_parallel_size if stages or experts else 1)
    return start_tensor_parallel(shard, spec.source.model_config.vocab_size, engine.tensor_parallel_timeout_s,
                                 backend=spec.backend,
                                 runner_class=(ExpertParallelRunner if experts else PipelineParallelRunner if stages
                                               else TensorParallelRunner))

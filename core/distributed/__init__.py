"""Tensor parallelism over torch.distributed: each rank holds a Megatron-style shard of
the decoder and the KV cache of its heads; rank 0 runs the engine (servelab.distributed.runner).

Submodules are imported where they are used, so a single-process engine loads none of
torch.distributed."""

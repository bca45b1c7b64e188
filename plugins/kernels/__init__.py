"""Built-in attention backends."""

import servelab
from servelab.plugin_types import AttentionPlugin
from servelab.plugins.kernels.options import CpuPagedOptions, CupyPagedOptions, TorchPagedOptions


@servelab.hookimpl
def servelab_register_attention():
    return [
        AttentionPlugin(
            name="torch-paged",
            factory="servelab.plugins.kernels.torch_paged:TorchPagedAttention",
            options=TorchPagedOptions,
            description="reference paged attention in torch: gathers K/V through block tables (CPU and GPU)",
        ),
        AttentionPlugin(
            name="cpu-paged",
            factory="servelab.plugins.kernels.cpu_paged:CpuPagedAttention",
            options=CpuPagedOptions,
            description="the default: paged attention and the decoder's layer ops in C++ for the CPU "
                        "(decodes row by row, prompts in flash-style query tiles); "
                        "torch-paged until its library is built and cached, and on other devices",
        ),
        AttentionPlugin(
            name="sdpa-contiguous",
            factory="servelab.plugins.kernels.sdpa_contiguous:SdpaContiguousAttention",
            description="torch SDPA over each sequence's K/V as a view of the cache; needs contiguous "
                        "block tables (allocator naive)",
        ),
        AttentionPlugin(
            name="cupy-paged",
            factory="servelab.plugins.kernels.cupy_paged:CupyPagedAttention",
            options=CupyPagedOptions,
            description="paged attention in raw CUDA through CuPy: GQA, online softmax, split-K "
                        "(needs CuPy and a CUDA GPU)",
        ),
    ]

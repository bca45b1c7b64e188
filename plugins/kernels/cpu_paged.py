"""`cpu-paged`: paged attention in C++ for the CPU.

Every row is attended by a C++ kernel (cpu_paged.cpp) that reads K and V straight from the
paged cache through each sequence's block table: nothing is gathered or copied. Rows of a
few query tokens (decodes, verified drafts) are one task per (sequence, KV head); rows of
many (prompts, chunks) are cut into tiles of query tokens attended flash-style, skipping
the keys past each tile's causal limit (about 3x torch's CPU flash attention on this
workload's prompts). Token trees (`AttentionMetadata.tree_parents`) are attended by
torch-paged's masked multi-token path, and their steps by the model's Python loop over
layers. `max_kernel_query_len`, when set, sends longer rows to torch-paged's
grouped scaled_dot_product_attention instead, as does a library without the tiled path (a
CPU without AVX2, or a head dim that is not a multiple of the vector width), for rows
longer than 16. The cache layout is torch-paged's.

The same library offers the model fused layer ops (`layer_ops`: RMSNorm with the residual
add, rotary in place, SiLU-and-multiply), which cut a decoder layer's small ops and their
Python dispatch (`layer_ops = false` keeps torch's), and, for steps whose every row the
kernel attends, the whole decoder in one native call (`decoder_forward`, see cpu_decoder;
`native_decoder = false` keeps the Python loop over layers), and a matmul the model's
linear layers move to (`panel_kernels`, see cpu_linear.cpp; `panel_linears = false` keeps
oneDNN's; by default bfloat16 layers stay on oneDNN where it computes them on AMX tiles), whose
library also runs a MoE block's routed experts in one call once they sit on its panels
(`panel_experts`, see cpu_moe.cpp and servelab.model.moe), and a matmul on quantized weight blocks for quantized linear layers
(`quant_kernels`, see cpu_quant.cpp).

The kernels compile on first use (see cpu_build) and are cached for later starts; an engine
that starts before they are cached (or where they cannot be built) serves every row on
the torch-paged path, which computes the same attention. `cpu-paged` is the default
backend: on a device other than the CPU it is torch-paged.
"""

from __future__ import annotations

import functools
import weakref

import attrs
import numpy as np
import torch
from torch.profiler import record_function

import servelab
from servelab.interfaces import AttentionContext, AttentionMetadata
from servelab.plugins.kernels.cpu_build import kernel_build
from servelab.plugins.kernels.cpu_decoder import native_decoder
from servelab.plugins.kernels.options import CpuPagedOptions, TorchPagedOptions
from servelab.plugins.kernels.torch_paged import TorchPagedAttention, _Host, _PrefillGroup, prefill_groups

logger = servelab.get_logger(__name__)  # silent below WARNING until the application configures logging


# Where the library has no tiled path, rows longer than this go to torch-paged's SDPA.
ROW_BY_ROW_LIMIT = 16


@functools.cache
def onednn_bf16_on_amx() -> bool:
    """Whether torch's oneDNN computes bfloat16 matmuls on AMX tiles on this CPU (they
    then beat the library's AVX-512 matmul several times over at batch sizes, and level at
    one row: docs/performance.md). False where torch cannot say."""
    cpu = torch.cpu
    try:
        return bool(torch.backends.mkldnn.is_available() and cpu._is_amx_tile_supported() and cpu._init_amx())
    except (AttributeError, RuntimeError):
        return False


class PanelsFor:
    """The library's matmul, offered for some of the weight dtypes it takes (a
    servelab.model.packed_linear.PanelKernels), and unless `experts` is false its grouped
    experts over such panels (servelab.model.moe.ExpertKernels)."""

    def __init__(self, kernels, dtypes: tuple[str, ...], experts: bool = True) -> None:
        self.kernels = kernels
        self.dtypes = dtypes
        self.pack_panels = kernels.pack_panels
        self.panel_linear = kernels.panel_linear
        if experts:
            self.panel_experts = kernels.panel_experts

    def panel_dtypes(self) -> list[str]:
        return [dtype for dtype in self.kernels.panel_dtypes() if dtype in self.dtypes]


@attrs.frozen
class _KernelPrepared:
    metadata: AttentionMetadata  # the step's slot mapping, block tables, query starts, context lengths
    kernel_seqs: torch.Tensor  # [K] sequences the kernel attends
    prefill_groups: tuple[_PrefillGroup, ...]  # the rest, as torch-paged attends them


class CpuPagedAttention(TorchPagedAttention):
    def __init__(self, options: CpuPagedOptions | None, context: AttentionContext) -> None:
        self.cpu_options = options or CpuPagedOptions()
        super().__init__(TorchPagedOptions(prefill_group_size=self.cpu_options.prefill_group_size,
                                           prefill_padding=self.cpu_options.prefill_padding,
                                           prefill_group_area=self.cpu_options.prefill_group_area), context)
        self._build = kernel_build()
        self._kernels = None
        self._decoders: dict[int, tuple[weakref.ref, object]] = {}  # id(model) -> (model, its native decoder or None)
        # "cached" never switches mid-run; "background" switches once its build lands.
        self._switch_when_built = self.cpu_options.build == "background"
        self._offered_panels: PanelsFor | None = None
        if context.device.type != "cpu":
            # The default backend everywhere: on another device it is torch-paged.
            logger.info("cpu_paged.not_cpu", device=str(context.device), fallback="torch-paged attention")
            return
        build = self.cpu_options.build
        if build == "wait":
            self._kernels = self._build.wait()
        elif build == "cached":
            self._kernels = self._build.load_cached()
            if self._kernels is None:
                self._build.start_later()
        elif build == "background":
            self._build.start(background=True)
        self._say_which_path(build)

    def _say_which_path(self, build: str) -> None:
        """One line at start-up: the attention path this run takes, and why."""
        if self._kernels is not None:
            logger.info("attention.path", path="cpu-paged C++ kernels", reason=f"build={build!r}: library loaded")
            return
        reason = {"never": "build='never' keeps every row on torch-paged",
                  "background": "build='background': the kernels are compiling; the run switches once they land",
                  "wait": f"the kernels could not be built ({self._build.error})",
                  "cached": "the kernels are not built on this machine yet; one background build (paused while "
                            "other work keeps the CPUs busy) prepares them for the next start, or run "
                            "`python -m servelab.plugins.kernels.cpu_build` once"}[build]
        # info, not a warning: a library stays silent on a normal start (a machine's first
        # run is on this path), and a warning would land on an unconfigured program's stdout
        logger.info("attention.path", path="torch-paged fallback", reason=reason)

    @property
    def kernels_ready(self) -> bool:
        return self._kernels is not None

    @property
    def layer_ops(self):
        """The library's fused layer ops (RMSNorm, residual add + RMSNorm, rotary, SiLU-and-
        multiply) for the model, once the kernels are ready; see servelab.model.llama.LayerOps.
        Set when a step is prepared, so a step never mixes the two paths."""
        return self._kernels if self.cpu_options.layer_ops else None

    @property
    def panel_kernels(self):
        """The library's matmul for the model's packed linear layers, once the kernels are
        ready (see servelab.model.packed_linear.use_panel_linears), offered for the dtypes
        `panel_linears` moves, and its grouped experts unless `native_experts` is false (see
        CpuPagedOptions)."""
        choice = self.cpu_options.panel_linears
        if self._kernels is None or choice is False:
            return None
        experts = self.cpu_options.native_experts
        if (choice is True or not onednn_bf16_on_amx()) and experts:
            return self._kernels
        if self._offered_panels is None:  # the library, once loaded, never changes
            dtypes = ("float32",) if choice == "auto" and onednn_bf16_on_amx() else tuple(self._kernels.panel_dtypes())
            self._offered_panels = PanelsFor(self._kernels, dtypes, experts)
        return self._offered_panels

    @property
    def sampling_kernels(self):
        """The library's draw of random rows straight from their logits (cpu_sampling.cpp),
        once the kernels are ready: servelab.sampler takes it for rows that only scale by a
        temperature."""
        return self._kernels

    @property
    def quant_kernels(self):
        """The library's matmul on quantized weight blocks, for a model loaded with
        `[engine] weights = "int8"` or `"int4"` (see servelab.model.quantized_linear), once
        the kernels are ready."""
        return self._kernels

    def decoder_forward(self, model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
                        kv_caches: list[tuple[torch.Tensor, torch.Tensor]], prepared,
                        logits_indices: torch.Tensor) -> torch.Tensor | None:
        """The final-normed hidden states of the `logits_indices` rows, the whole decoder run
        in one native call; None when this step (some rows are prompts) or this model (see
        cpu_decoder) takes the model's Python path. Bit-identical to the fused Python path."""
        if (not isinstance(prepared, _KernelPrepared) or prepared.prefill_groups
                or not (self.cpu_options.native_decoder and self.cpu_options.layer_ops)):
            return None
        decoder = self._decoder_for(model)
        if decoder is None:
            return None
        metadata = prepared.metadata
        arguments = (model, input_ids, positions, [cache for pair in kv_caches for cache in pair],
                     metadata.block_tables, metadata.query_start_loc, metadata.context_lens, metadata.slot_mapping,
                     prepared.kernel_seqs, logits_indices)
        if torch.autograd._profiler_enabled():  # the label costs ~6 us a step even with no profiler on
            with record_function("cpu_paged::decoder"):
                return decoder.forward(*arguments)
        return decoder.forward(*arguments)

    def _decoder_for(self, model: torch.nn.Module):
        entry = self._decoders.get(id(model))
        if entry is None or entry[0]() is not model:
            entry = (weakref.ref(model), native_decoder(self._kernels, model))
            self._decoders[id(model)] = entry
        return entry[1]

    @functools.cached_property
    def _kernel_row_limit(self) -> int | None:
        """Rows with more query tokens go to SDPA; None: the kernel attends every row. Asked
        once the kernels are loaded (they never change after)."""
        limit = self.cpu_options.max_kernel_query_len or None
        if limit is None and not self._kernels.tiles_prompts(self.context.head_dim):
            limit = ROW_BY_ROW_LIMIT  # no tiled path here (no AVX2, or an odd head dim): prompts to SDPA
        return limit

    def prepare(self, metadata: AttentionMetadata):
        if self._kernels is None:
            if self._switch_when_built and self.context.device.type == "cpu":
                self._kernels = self._build.module()
            if self._kernels is None:
                return super().prepare(metadata)
        limit = self._kernel_row_limit
        query_lens, context_lens = metadata.query_lens_list, metadata.context_lens_list
        trees = metadata.tree_parents
        if limit is None and trees is None:
            short, long = list(range(len(query_lens))), []
        else:
            limit = limit or max(query_lens)
            # The kernel attends causally: token trees go to torch-paged's masked path.
            is_tree = (lambda i: trees[i] is not None) if trees is not None else (lambda i: False)
            short = [i for i, q in enumerate(query_lens) if q <= limit and not is_tree(i)]
            long = [i for i, q in enumerate(query_lens) if q > limit or is_tree(i)]
        groups: tuple[_PrefillGroup, ...] = ()
        if long:
            host = _Host(metadata, self.context.num_kv_heads, self.context.num_blocks)
            options = self.options
            groups = tuple(
                self._prefill_group(host, [long[i] for i in group])
                for group in prefill_groups([query_lens[i] for i in long], [context_lens[i] for i in long],
                                            options.prefill_group_size, options.prefill_padding,
                                            options.prefill_group_area))
        return _KernelPrepared(metadata, torch.from_numpy(np.asarray(short, dtype=np.int64)), groups)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_cache: torch.Tensor, value_cache: torch.Tensor, prepared, scale: float) -> torch.Tensor:
        if not isinstance(prepared, _KernelPrepared):
            return super().forward(query, key, value, key_cache, value_cache, prepared, scale)
        kernels, metadata = self._kernels, prepared.metadata
        with record_function("cpu_paged::attend"):  # the C++ calls are invisible to the profiler otherwise
            # q, k and v may be strided views of one projection: the kernels read rows in place.
            kernels.write_cache(key, value, key_cache, value_cache, metadata.slot_mapping)
            output = query.new_empty(query.shape)
            if prepared.kernel_seqs.numel():
                kernels.attend(query, key_cache, value_cache, metadata.block_tables, metadata.query_start_loc,
                               metadata.context_lens, prepared.kernel_seqs, scale, output)
        for group in prepared.prefill_groups:
            output.index_copy_(0, group.output_rows, self._prefill(query, key_cache, value_cache, group, scale))
        return output

"""Linear layers with weights pre-packed for oneDNN's CPU matmul kernels.

torch's default CPU linear goes through MKL's GEMM, which on this project's machines is
slower than oneDNN at every batch size served (docs/performance.md). oneDNN wants its
weights in its own blocked layout: packing them once at load time, as vLLM's CPU build
does, keeps that cost out of every step.

`prepack_linears` swaps every nn.Linear under a module for a `PackedLinear` in place. The
unpacked weight is dropped unless `keep_weights` names the layer: the LM head keeps it,
since drafters and tied embeddings read it as a plain tensor.

Once an attention backend's native library is loaded, the layers can move to its matmul
(`use_panel_linears`, see plugins/kernels/cpu_linear.cpp; float32 and bfloat16 wherever it
builds): each weight is repacked into the library's panels and the oneDNN copy is freed, so
the weights are held once. The library's kernel is level with oneDNN at prompt sizes and
faster at decode sizes (docs/performance.md), except for bfloat16 on a CPU with AMX, where
oneDNN's tiles win and the backend offers only float32 (`panel_linears = "auto"`). Where this torch cannot pack a dtype for
oneDNN on this CPU (bfloat16 without AVX-512), `prepack_linears(..., onednn=False)` wraps
the layers all the same, holding their plain weights for torch's linear until the panels
take them over.
"""

from __future__ import annotations

import functools
from typing import Any, Protocol

import torch
from torch import nn
from torch.profiler import record_function

from servelab.logging_setup import get_logger
from servelab.model.memory import trim_heap

logger = get_logger(__name__)
PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


class PackedLinear(nn.Module):
    """y = x W^T + b with W held as a oneDNN-packed tensor (CPU only), or with `onednn`
    false as the plain weight, until a native library's panels take it (`use_panels`)."""

    def __init__(self, linear: nn.Linear, keep_weight: bool = False, onednn: bool = True) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.dtype = linear.weight.dtype
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach()) if onednn else None
        self.bias = None if linear.bias is None else linear.bias.detach()
        self._keep_weight = keep_weight
        if keep_weight or not onednn:  # the same Parameter: a tied embedding stays tied
            self.weight = linear.weight

        self.panels: torch.Tensor | None = None  # the weight as the library's panels, once moved there
        self._kernels: Any = None
        self._profile_name = ""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is None:
            if self.packed_weight is None:
                return nn.functional.linear(x, self.weight, self.bias)
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        if torch.autograd._profiler_enabled():  # a library call is invisible to torch's profiler otherwise
            with record_function(self._profile_name):
                return self._kernels.panel_linear(x, self.panels, self.bias, self.out_features)
        return self._kernels.panel_linear(x, self.panels, self.bias, self.out_features)

    def use_panels(self, kernels: Any, profile_name: str = "cpu_paged::linear") -> bool:
        """Move this layer (still on oneDNN) onto `kernels`' matmul (see PanelKernels);
        False, leaving it on oneDNN, where the library has no kernel for the layer's dtype.
        `profile_name` names its calls in torch's profiler."""
        if str(self.dtype).removeprefix("torch.") not in kernels.panel_dtypes():
            return False
        weight = self.weight.detach() if hasattr(self, "weight") else self.unpacked_weight()
        self.panels, self._kernels, self._profile_name = kernels.pack_panels(weight), kernels, profile_name
        self.packed_weight = None
        if not self._keep_weight and hasattr(self, "weight"):
            del self.weight
        return True

    def unpacked_weight(self) -> torch.Tensor:
        """The plain [out, in] weight, read back out of oneDNN's layout (which no public API
        exposes) as the layer's output for the identity: each output is one product by 1,
        so the values are exact."""
        identity = torch.eye(self.in_features, dtype=self.packed_weight.dtype)
        return torch.ops.mkldnn._linear_pointwise(identity, self.packed_weight, None, "none", [], "").t().contiguous()


class PanelKernels(Protocol):
    """A native library's matmul on weights packed its own way (cpu_linear.cpp)."""

    def panel_dtypes(self) -> list[str]:
        """The weight dtypes it takes here ("float32", "bfloat16"; none: no such kernel)."""

    def pack_panels(self, weight: torch.Tensor) -> torch.Tensor: ...

    def panel_linear(self, x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None,
                     out_features: int) -> torch.Tensor: ...


def use_panel_linears(root: nn.Module, kernels: PanelKernels) -> int:
    """Move every PackedLinear under `root` whose dtype `kernels` takes onto its matmul, one
    layer at a time (so the two copies of one weight at most coexist); returns how many moved."""
    moved = 0
    for name, module in root.named_modules():
        if isinstance(module, PackedLinear) and module.panels is None:
            if module.use_panels(kernels, "cpu_paged::lm_head" if name.endswith("lm_head") else "cpu_paged::linear"):
                moved += 1
                trim_heap()  # the freed oneDNN copy: glibc would keep it as a resident hole in its heap
    return moved


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch build packs linear weights for oneDNN on this device and dtype,
    on this CPU (bfloat16 packing needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT: asked once)."""
    return (device.type == "cpu" and dtype in PACKABLE_DTYPES and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and _packs(dtype))


@functools.cache
def _packs(dtype: torch.dtype) -> bool:
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype))
    except RuntimeError:
        return False
    return True


def prepack_linears(root: nn.Module, keep_weights: tuple[str, ...] = (), onednn: bool = True) -> int:
    """Replace every nn.Linear under `root` by a PackedLinear; returns how many. Layers
    named in `keep_weights` (attribute names, e.g. "lm_head") keep their plain weight too.
    `onednn` false (see can_prepack) wraps them with their plain weights, for panels later.

    Falls back (one warning, nothing replaced) when a weight cannot be packed or the packed
    layer disagrees with the original on a probe input.
    """
    targets = [(parent, name, child) for parent in root.modules()
               for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    try:
        packed = [(parent, name, PackedLinear(child, keep_weight=name in keep_weights, onednn=onednn))
                  for parent, name, child in targets]
        if targets and onednn:
            _check_probe(targets[0][2], packed[0][2])
    except (RuntimeError, AttributeError) as exc:
        logger.warning("packed_linear.unavailable", reason=str(exc).splitlines()[0][:200])
        return 0
    for parent, name, module in packed:
        setattr(parent, name, module)
    return len(packed)


def _check_probe(linear: nn.Linear, packed: PackedLinear) -> None:
    with torch.inference_mode():
        probe = torch.linspace(-1, 1, 3 * linear.in_features, dtype=linear.weight.dtype).view(3, -1)
        expected, got = linear(probe).float(), packed(probe).float()
    tolerance = 1e-3 if linear.weight.dtype == torch.float32 else 5e-2
    if not torch.allclose(expected, got, rtol=tolerance, atol=tolerance * float(expected.abs().max()) + 1e-6):
        raise RuntimeError("packed linear disagrees with torch's linear on a probe input")

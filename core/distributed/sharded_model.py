"""One rank's shard of the decoder, read straight from the checkpoint's safetensors slices.

The decoder is `servelab.model.llama`'s, built with the rank's local shape (its query and
KV heads, its share of the MLP width, its vocabulary rows); then the layers that need a
collective are swapped in place:

- column-parallel (no communication): the fused QKV projection (this rank's heads) and
  the fused gate/up projection (this rank's share of the intermediate dimension);
- row-parallel, one all-reduce each: the attention output and MLP down projections, whose
  bias (if any) is added once, after the sum;
- vocab-parallel: the embedding (rows outside the rank's range read as zeros, then one
  all-reduce) and the LM head (each rank's logits columns gathered to rank 0).

Linear layers are packed for oneDNN (`[engine] prepack_weights`) after sharding, so each
rank packs only its own slices.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from torch.nn import functional as F

from servelab.distributed.comm import Communicator
from servelab.distributed.pipeline_parallel import AbsentLayer, prune_layers
from servelab.model.shard_layout import ShardLayout
from servelab.errors import CheckpointError
from servelab.model.llama import LlamaForCausalLM
from servelab.model.loader import DTYPES, Checkpoint, allocate_parameters
from servelab.model.memory import release_freed_memory
from servelab.model.packed_linear import can_prepack, prepack_linears
from servelab.model.rope import RotaryEmbedding


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_r W_r^T, plus the bias once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, comm: Communicator) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, out_features, bias=False)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.comm.all_reduce(self.linear(x))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding rows [start, start + rows) on this rank; the others' rows come from the all-reduce."""

    def __init__(self, rows: int, hidden_size: int, start: int, num_valid: int, comm: Communicator) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))
        self.start = start
        self.num_valid = num_valid
        self.comm = comm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.num_valid)
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight)
        hidden.masked_fill_(outside.unsqueeze(-1), 0)
        return self.comm.all_reduce(hidden)


class VocabParallelHead(nn.Module):
    """Logits columns of this rank's vocabulary rows, gathered on rank 0 (others get [R, 0])."""

    def __init__(self, hidden_size: int, rows: int, vocab_size: int, comm: Communicator) -> None:
        super().__init__()
        self.projection = nn.Linear(hidden_size, rows, bias=False)
        self.vocab_size = vocab_size
        self.comm = comm

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.comm.gather_columns(self.projection(hidden), self.vocab_size)


class CheckpointSlices:
    """Named tensors of a checkpoint's safetensors files, read a slice at a time (or of any
    mapping of tensors, such as a GGUF file's, each read whole and then sliced: block
    quantization does not slice by rows)."""

    def __init__(self, path: Path | None, tensors: Mapping[str, torch.Tensor] | None = None) -> None:
        self.bytes_read = 0
        self._tensors = tensors
        self._where: dict = {}
        if tensors is not None:
            self._where = {name: None for name in tensors}
            return
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"checkpoint directory {str(path)!r} has no *.safetensors weights")
        self._handles = [safe_open(str(file), framework="pt", device="cpu") for file in files]
        for handle in self._handles:
            for name in handle.keys():
                self._where[name.removeprefix("model.")] = (handle, name)

    @classmethod
    def of(cls, checkpoint: Checkpoint) -> "CheckpointSlices":
        return cls(checkpoint.path) if checkpoint.gguf is None else cls(None, checkpoint.tensors())

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def read(self, name: str, rows: tuple[int, int] | None = None, columns: tuple[int, int] | None = None,
             pad_rows: int | None = None) -> torch.Tensor:
        """The tensor, or its rows / columns [start, end); zero rows appended up to `pad_rows`."""
        if name not in self._where:
            raise CheckpointError(f"checkpoint is missing weight {name!r}")
        if self._tensors is not None:
            piece = self._tensors[name]
        else:
            handle, key = self._where[name]
            piece = handle.get_slice(key)
        if rows is not None:
            tensor = piece[rows[0]:rows[1]]
        elif columns is not None:
            tensor = piece[:, columns[0]:columns[1]]
        else:
            tensor = piece[:]
        self.bytes_read += tensor.numel() * tensor.element_size()
        if pad_rows is not None and tensor.shape[0] < pad_rows:
            tensor = torch.cat([tensor, tensor.new_zeros((pad_rows - tensor.shape[0], *tensor.shape[1:]))])
        return tensor


def build_shard(checkpoint: Checkpoint, layout: ShardLayout, comm: Communicator, dtype: str, device: str,
                max_positions: int, prepack_weights: bool = False, layers: range | None = None) -> LlamaForCausalLM:
    """This rank's decoder shard, weights read from the checkpoint's slices only; with
    `layers` (a pipeline stage's), the other layers are AbsentLayers and read nothing."""
    torch_dtype = DTYPES[dtype]
    torch_device = torch.device(device)
    config = checkpoint.config
    local = layout.local_config()
    rotary = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta, config.rope_scaling,
                             torch_dtype, torch_device)
    vocab_start, vocab_end = layout.vocab
    with torch.device("meta"):
        model = LlamaForCausalLM(local, rotary).to(torch_dtype)
        model.embed_tokens = VocabParallelEmbedding(layout.vocab_per_rank, config.hidden_size, vocab_start,
                                                    vocab_end - vocab_start, comm)
        model.lm_head = VocabParallelHead(config.hidden_size, layout.vocab_per_rank, config.vocab_size, comm)
        if layers is not None:
            prune_layers(model, layers)
        for layer in model.layers:
            if isinstance(layer, AbsentLayer):
                continue
            layer.self_attn.o_proj = RowParallelLinear(local.num_heads * config.head_dim, config.hidden_size,
                                                       config.o_bias, comm)
            layer.mlp.down_proj = RowParallelLinear(local.intermediate_size, config.hidden_size, config.mlp_bias, comm)
        model = model.to(torch_dtype)
    allocate_parameters(model, torch_device)  # once, in the target dtype
    if config.tie_word_embeddings:
        model.lm_head.projection.weight = model.embed_tokens.weight
    _load_slices(model, CheckpointSlices.of(checkpoint), layout)
    if prepack_weights and can_prepack(torch_device, torch_dtype):
        prepack_linears(model)
    release_freed_memory()
    return model.eval()


def _load_slices(model: LlamaForCausalLM, slices: CheckpointSlices, layout: ShardLayout) -> None:
    config = layout.config
    d = config.head_dim
    q_rows = tuple(h * d for h in layout.heads)
    kv_rows = tuple(h * d for h in layout.kv_heads)
    mlp = layout.intermediate
    vocab_rows = layout.vocab_per_rank
    assignments: list[tuple[torch.Tensor, torch.Tensor]] = [
        (model.embed_tokens.weight, slices.read("embed_tokens.weight", layout.vocab, pad_rows=vocab_rows)),
        (model.norm.weight, slices.read("norm.weight")),
    ]
    if not config.tie_word_embeddings:
        assignments.append((model.lm_head.projection.weight,
                            slices.read("lm_head.weight", layout.vocab, pad_rows=vocab_rows)))
    for i, layer in enumerate(model.layers):
        if isinstance(layer, AbsentLayer):
            continue
        p = f"layers.{i}."
        attn, mlp_module = layer.self_attn, layer.mlp
        qkv = [slices.read(p + "self_attn.q_proj.weight", q_rows), slices.read(p + "self_attn.k_proj.weight", kv_rows),
               slices.read(p + "self_attn.v_proj.weight", kv_rows)]
        assignments += [
            (layer.input_layernorm.weight, slices.read(p + "input_layernorm.weight")),
            (layer.post_attention_layernorm.weight, slices.read(p + "post_attention_layernorm.weight")),
            (attn.qkv_proj.weight, torch.cat(qkv)),
            (attn.o_proj.linear.weight, slices.read(p + "self_attn.o_proj.weight", columns=q_rows)),
            (mlp_module.gate_up_proj.weight, torch.cat([slices.read(p + "mlp.gate_proj.weight", mlp),
                                                        slices.read(p + "mlp.up_proj.weight", mlp)])),
            (mlp_module.down_proj.linear.weight, slices.read(p + "mlp.down_proj.weight", columns=mlp)),
        ]
        if config.qkv_bias:
            assignments.append((attn.qkv_proj.bias, torch.cat([
                slices.read(p + "self_attn.q_proj.bias", q_rows), slices.read(p + "self_attn.k_proj.bias", kv_rows),
                slices.read(p + "self_attn.v_proj.bias", kv_rows)])))
        if config.o_bias:
            assignments.append((attn.o_proj.bias, slices.read(p + "self_attn.o_proj.bias")))
        if config.mlp_bias:
            assignments += [
                (mlp_module.gate_up_proj.bias, torch.cat([slices.read(p + "mlp.gate_proj.bias", mlp),
                                                          slices.read(p + "mlp.up_proj.bias", mlp)])),
                (mlp_module.down_proj.bias, slices.read(p + "mlp.down_proj.bias")),
            ]
    with torch.no_grad():
        for target, source in assignments:
            if source.shape != target.shape:
                raise CheckpointError(f"a weight slice has shape {tuple(source.shape)}, expected {tuple(target.shape)}")
            target.copy_(source)
    model.bytes_read = slices.bytes_read


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of the weights the module holds (each shared tensor counted once; packed ones too)."""
    seen: dict[int, int] = {}
    for tensor in list(model.parameters()) + [m.packed_weight for m in model.modules() if hasattr(m, "packed_weight")]:
        seen[id(tensor)] = tensor.numel() * tensor.element_size()
    return sum(seen.values())

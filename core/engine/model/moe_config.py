"""The mixture-of-experts numbers of a Hugging Face `config.json` (Mixtral, Qwen2-MoE,
Qwen3-MoE): how many experts, how many a token takes, their width, the shared expert,
which layers are sparse and how the router's weights are normalised and rounded."""

from __future__ import annotations

from typing import Any

import attrs

from servelab.errors import CheckpointError

# model_type -> (the checkpoint's name of a layer's sparse block, its experts' projections
# gate/up/down, whether the top-k weights always sum to one, whether they keep float32
# when multiplied into the experts' outputs)
_FAMILIES = {
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2"), True, True),
    "qwen2_moe": ("mlp", ("gate_proj", "up_proj", "down_proj"), False, False),
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj"), False, False),
}
MOE_MODEL_TYPES = tuple(_FAMILIES)


@attrs.frozen(kw_only=True)
class MoEShape:
    """The sparse layers of a mixture-of-experts decoder."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    norm_topk_prob: bool  # the k chosen weights divided by their sum
    float_weights: bool  # the k weights multiply the experts' outputs in float32 (Mixtral)
    shared_expert_intermediate_size: int  # 0: no shared expert (Qwen2-MoE has one, behind a sigmoid gate)
    sparse_layers: tuple[int, ...]  # the other layers keep a dense MLP of intermediate_size
    checkpoint_block: str  # "block_sparse_moe" (Mixtral) or "mlp"
    checkpoint_projections: tuple[str, str, str]  # an expert's gate, up, down names in the checkpoint
    routing: str = "standard"  # the top-k policy (servelab.model.expert_routing)
    num_expert_groups: int = 1  # grouped top-k: experts fall in this many groups ...
    topk_groups: int = 1  # ... and a token picks among the experts of its best groups

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "MoEShape | None":
        """None for a dense model type."""
        model_type = raw.get("model_type")
        if model_type not in _FAMILIES:
            return None
        block, projections, always_norm, float_weights = _FAMILIES[model_type]
        try:
            # the expert count is `num_local_experts` (Mixtral; Qwen3-MoE as transformers 5 writes
            # it) or `num_experts` (the Qwen MoEs' own configs)
            count_key = "num_experts" if "num_experts" in raw else "num_local_experts"
            num_experts = int(raw[count_key])
            width = int(raw["intermediate_size" if model_type == "mixtral" else "moe_intermediate_size"])
            top_k = int(raw["num_experts_per_tok"])
        except KeyError as exc:
            raise CheckpointError(f"{model_type} config.json lacks required key {exc.args[0]!r}") from None
        if not 1 <= top_k <= num_experts:
            raise CheckpointError(f"num_experts_per_tok={top_k} must lie in 1..{num_experts} (the expert count)")
        num_layers = int(raw.get("num_hidden_layers", 0))
        step = int(raw.get("decoder_sparse_step", 1) or 1)
        dense_only = set(raw.get("mlp_only_layers") or ())
        sparse = tuple(i for i in range(num_layers) if i not in dense_only and (i + 1) % step == 0)
        shared = int(raw.get("shared_expert_intermediate_size") or 0) if model_type == "qwen2_moe" else 0
        groups = int(raw.get("n_group") or 1)
        return cls(routing="grouped" if groups > 1 else "standard", num_expert_groups=groups,
                   topk_groups=int(raw.get("topk_group") or groups),
                   num_experts=num_experts, top_k=top_k, expert_intermediate_size=width,
                   norm_topk_prob=always_norm or bool(raw.get("norm_topk_prob", False)),
                   float_weights=float_weights, shared_expert_intermediate_size=shared, sparse_layers=sparse,
                   checkpoint_block=block, checkpoint_projections=projections)

    def expert_params_per_layer(self, hidden_size: int) -> int:
        """Weights of one sparse layer's routed experts (the router and shared expert aside)."""
        return self.num_experts * 3 * hidden_size * self.expert_intermediate_size

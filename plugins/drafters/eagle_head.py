"""The EAGLE-style draft head: one decoder layer over the target's fused features.

Input at position t is the pair (feature of position t, token at t + 1); its output h_t
stands in for the target's feature of position t + 1 and, through a norm and the
target's own LM head, predicts the token at t + 2. Drafting goes on from the head's own
output (EAGLE-3's "training-time test" teaches it to read its own outputs):

    g_t   = fuse([norm_1(f1_t), norm_2(f2_t), norm_3(f3_t)])      (EAGLE-3: several layers)
    u_t   = input_proj([g_t, embed_norm(E[x_{t+1}])])               (E: the target's embeddings)
    h_t   = u_t + attn(norm(u_t)) ;  h_t = h_t + mlp(norm(h_t))     (a Llama layer, RoPE at t)
    p(x_{t+2}) = softmax(lm_head(out_norm(h_t)))       (the target's LM head, or the head's
                                                        own over a reduced draft vocabulary)
    next: u_{t+1} = input_proj([h_t, embed_norm(E[x̂_{t+2}])]) at position t + 1

The same module serves training (batched windows, `attention_keys` under an explicit mask)
and the drafter (one sequence's cache at a time). Weights: `eagle.safetensors` with the
parameter names of this module, and `eagle_config.json` (HeadConfig's fields).
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import torch
from torch import nn
from torch.nn import functional as F

HEAD_FILE = "eagle.safetensors"
CONFIG_FILE = "eagle_config.json"


@attrs.frozen(kw_only=True)
class HeadConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    feature_layers: tuple[int, ...] = attrs.field(converter=tuple)  # the target's decoder layers it reads
    # EAGLE-3's reduced draft vocabulary: the head's own LM head over this many tokens (the
    # most frequent in the target's outputs, `draft_tokens`); 0: the target's LM head, every token.
    draft_vocab_size: int = 0
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    @classmethod
    def load(cls, directory: Path) -> "HeadConfig":
        data = json.loads((directory / CONFIG_FILE).read_text())
        return cls(**{field.name: data[field.name] for field in attrs.fields(cls) if field.name in data})

    def save(self, directory: Path) -> None:
        (directory / CONFIG_FILE).write_text(json.dumps(attrs.asdict(self), indent=2) + "\n")


class RMSNorm(nn.Module):
    """Kept apart from the model's (servelab.model.llama.RMSNorm) on purpose: a plugin reaches
    only servelab's public surface, and the head's norm is one fused kernel in the model's
    dtype (drafting calls it per token), where the model's normalises in float32 as the
    reference implementation does."""

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one kernel: drafting calls it per token


class EagleHead(nn.Module):
    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        self.config = c = config
        hidden = c.hidden_size
        self.feature_norms = nn.ModuleList(RMSNorm(hidden, c.rms_norm_eps) for _ in c.feature_layers)
        self.fuse = nn.Linear(len(c.feature_layers) * hidden, hidden, bias=False)
        self.embed_norm = RMSNorm(hidden, c.rms_norm_eps)
        self.input_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.input_layernorm = RMSNorm(hidden, c.rms_norm_eps)
        self.q_proj = nn.Linear(hidden, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, hidden, bias=False)
        self.post_attention_layernorm = RMSNorm(hidden, c.rms_norm_eps)
        self.gate_proj = nn.Linear(hidden, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, hidden, bias=False)
        self.out_norm = RMSNorm(hidden, c.rms_norm_eps)
        if c.draft_vocab_size:
            self.lm_head = nn.Linear(hidden, c.draft_vocab_size, bias=False)
            self.register_buffer("draft_tokens", torch.zeros(c.draft_vocab_size, dtype=torch.int64))
        d = c.head_dim
        self.register_buffer("inv_freq", 1.0 / (c.rope_theta ** (torch.arange(0, d, 2).float() / d)), persistent=False)
        self._fused: tuple[torch.Tensor, torch.Tensor] | None = None  # (qkv, gate_up) weights, for drafting
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin [positions, d] tables

    def fuse_for_inference(self) -> None:
        """Concatenate the q/k/v and gate/up weights (fewer, larger matmuls per draft token);
        the parameters themselves stay as they are. Call again after changing them."""
        self._fused = (torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]),
                       torch.cat([self.gate_proj.weight, self.up_proj.weight]))

    # ------------------------------------------------------------------ the pieces of a pass

    def fused(self, features: torch.Tensor) -> torch.Tensor:
        """[..., len(feature_layers) * hidden] target features -> g [..., hidden]."""
        parts = features.chunk(len(self.feature_norms), dim=-1)
        return self.fuse(torch.cat([norm(part) for norm, part in zip(self.feature_norms, parts)], dim=-1))

    def inputs(self, x: torch.Tensor, token_embeddings: torch.Tensor) -> torch.Tensor:
        """u from the feature (or the head's previous output) and the next token's embedding."""
        return self.input_proj(torch.cat([x, self.embed_norm(token_embeddings)], dim=-1))

    def qkv(self, u: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """u [..., T, hidden] at positions [T] (or [B, T] for u [B, T, hidden]) -> q [..., heads, T, d],
        k and v [..., kv_heads, T, d]."""
        c = self.config
        x = self.input_layernorm(u)
        shape = x.shape[:-1]
        if self._fused is not None:
            q, k, v = F.linear(x, self._fused[0]).split(
                [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.reshape(*shape, c.num_heads, c.head_dim).transpose(-2, -3)
        k = k.reshape(*shape, c.num_kv_heads, c.head_dim).transpose(-2, -3)
        v = v.reshape(*shape, c.num_kv_heads, c.head_dim).transpose(-2, -3)
        cos, sin = self._rope_tables(positions, q.dtype)
        if positions.dim() > 1:  # per-row positions [B, T]: broadcast over the heads
            cos, sin = cos.unsqueeze(-3), sin.unsqueeze(-3)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v

    def _rope_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, head_dim] at positions, from tables grown as positions come."""
        needed = int(positions.max()) + 1 if positions.numel() else 1
        if self._rope is None or self._rope[0].shape[0] < needed or self._rope[0].dtype != dtype:
            size = max(needed, 2 * (self._rope[0].shape[0] if self._rope is not None else 1024))
            freqs = torch.outer(torch.arange(size, device=self.inv_freq.device).float(), self.inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            self._rope = (emb.cos().to(dtype), emb.sin().to(dtype))
        return self._rope[0][positions], self._rope[1][positions]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """q [..., heads, T, d] over k, v [..., kv_heads, S, d] where mask [T, S] (True: seen;
        None: every key)."""
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                              enable_gqa=self.config.num_heads != self.config.num_kv_heads)

    def finish(self, u: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The layer's output h from its input u and the attention output [..., heads, T, d]."""
        c = self.config
        out = attended.transpose(-2, -3).reshape(*u.shape[:-1], c.num_heads * c.head_dim)
        h = u + self.o_proj(out)
        x = self.post_attention_layernorm(h)
        if self._fused is not None:
            gate, up = F.linear(x, self._fused[1]).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return h + self.down_proj(F.silu(gate) * up)

    # ------------------------------------------------------------------ training

    def unrolled(self, g: torch.Tensor, token_embeddings: torch.Tensor, depth: int) -> list[torch.Tensor]:
        """Training-time test over windows: g [B, N, hidden] the fused features of positions
        0..N-1, token_embeddings [B, N + depth, hidden] of tokens 1..N + depth. Step j's row t
        reads the head's step j - 1 output and token t + 1 + j, at position t + j, seeing the
        step-0 keys of positions <= t and its own steps' keys at row t: exactly what drafting
        j tokens past position t sees. Returns the outputs h of each step [B, N, hidden]."""
        n = g.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool, device=g.device).tril()
        diagonal = torch.eye(n, dtype=torch.bool, device=g.device)
        keys, values, outputs = [], [], []
        x = g
        for step in range(depth):
            u = self.inputs(x, token_embeddings[:, step: step + n])
            q, k, v = self.qkv(u, torch.arange(step, step + n, device=g.device))
            keys.append(k)
            values.append(v)
            mask = torch.cat([causal] + [diagonal] * step, dim=1)
            x = self.finish(u, self.attend(q, torch.cat(keys, dim=-2), torch.cat(values, dim=-2), mask))
            outputs.append(x)
        return outputs


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def load_head(directory: Path, dtype: torch.dtype, device: torch.device) -> EagleHead:
    from safetensors.torch import load_file

    head = EagleHead(HeadConfig.load(directory))
    head.load_state_dict({name: tensor if name == "draft_tokens" else tensor.float()
                          for name, tensor in load_file(str(directory / HEAD_FILE)).items()})
    head = head.to(device=device, dtype=dtype).eval().requires_grad_(False)  # .to(dtype) keeps int buffers
    head.fuse_for_inference()
    return head


def save_head(head: EagleHead, directory: Path, dtype: torch.dtype) -> None:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().contiguous() if name == "draft_tokens" else t.detach().to(dtype).contiguous()
               for name, t in head.state_dict().items()}
    save_file(tensors, str(directory / HEAD_FILE), metadata={"format": "pt"})
    head.config.save(directory)

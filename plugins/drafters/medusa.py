"""Medusa-1 drafting (Cai et al. 2024): k small heads read the target's final-normed
hidden state x at the position that produced the last token t and guess the tokens
after it. Head i (0-based) is one residual SiLU layer feeding the target's own LM head:

    logits_i = lm_head(x + silu(W_i x + b_i))     guesses the token i + 1 places after t

The drafts are the heads' top-1 tokens, verified as a chain (deterministic proposals,
so q is one-hot and verification stays lossless for sampled requests too). The heads
cost one small matmul each per sequence: no extra model pass.

Heads file: `medusa.safetensors` (tensors medusa_heads.{i}.weight [hidden, hidden] and
medusa_heads.{i}.bias [hidden]) and `medusa_config.json` ({"num_heads": K,
"hidden_size": H}) in the target checkpoint's directory or the `heads` option's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping, Sequence as Seq

import torch

from servelab.errors import ConfigError
from servelab.interfaces import DrafterContext, Sequence
from servelab.plugins.drafters.options import MedusaOptions

HEADS_FILE = "medusa.safetensors"
CONFIG_FILE = "medusa_config.json"


class MedusaDrafter:
    needs_hidden_states = True

    def __init__(self, options: MedusaOptions | None, context: DrafterContext) -> None:
        from safetensors.torch import load_file

        self.options = options or MedusaOptions()
        target = context.target
        if target is None:
            raise ConfigError("drafter 'medusa' reads the target model's hidden states; this engine has no model")
        directory = Path(self.options.heads or target.path or ".")
        if not (directory / HEADS_FILE).is_file() or not (directory / CONFIG_FILE).is_file():
            raise ConfigError(f"drafter 'medusa': no {HEADS_FILE} and {CONFIG_FILE} in {str(directory)!r}; "
                              f"set [drafter] heads to the directory holding trained heads")
        config = json.loads((directory / CONFIG_FILE).read_text())
        if config.get("hidden_size") != target.hidden_size:
            raise ConfigError(f"drafter 'medusa': heads in {str(directory)!r} were trained for hidden size "
                              f"{config.get('hidden_size')}, the target's is {target.hidden_size}")
        num_heads = int(config["num_heads"])
        k = self.options.num_speculative_tokens or num_heads
        if k > num_heads:
            raise ConfigError(f"[drafter] num_speculative_tokens={k} but only {num_heads} Medusa heads were trained")
        tensors = load_file(str(directory / HEADS_FILE))
        dtype, device = target.dtype or torch.float32, target.device or torch.device("cpu")
        self.weight = torch.stack([tensors[f"medusa_heads.{i}.weight"] for i in range(k)]).to(device, dtype)
        self.bias = torch.stack([tensors[f"medusa_heads.{i}.bias"] for i in range(k)]).to(device, dtype)
        self.lm_head = target.lm_head
        self.k = k
        self.max_model_len = context.max_model_len

    def propose(self, seqs: Seq[Sequence], hidden_states: torch.Tensor | None = None) -> Mapping[str, list[int]]:
        if not seqs or hidden_states is None:
            return {}
        with torch.inference_mode():
            x = hidden_states.to(self.weight.dtype)  # [B, H]
            residual = torch.nn.functional.silu(torch.einsum("bh,koh->bko", x, self.weight) + self.bias)
            heads = x[:, None, :] + residual  # [B, k, H]
            tokens = self.lm_head(heads.reshape(-1, heads.shape[-1])).argmax(dim=-1).view(len(seqs), self.k)
        drafts = tokens.tolist()
        return {seq.request_id: draft[: max(0, self.max_model_len - seq.num_tokens)]
                for seq, draft in zip(seqs, drafts)}

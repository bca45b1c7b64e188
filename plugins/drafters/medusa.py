"""Medusa-1 drafting (Cai et al. 2024): k small heads read the target's final-normed
hidden state x at the position that produced the last token t and guess the tokens
after it. Head i (0-based) is one residual SiLU layer feeding the target's own LM head:

    logits_i = lm_head(x + silu(W_i x + b_i))     guesses the token i + 1 places after t

The drafts are the heads' top-1 tokens, verified as a chain (deterministic proposals,
so q is one-hot and verification stays lossless for sampled requests too). With
`tree_nodes = N` they are a token tree instead: the static tree of N nodes over the
heads' top-k tokens that their measured accuracies make most likely to be accepted
(servelab.plugins.drafters.medusa_tree), as Medusa's sparse trees are. The heads cost
one small matmul each per sequence: no extra model pass.

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
from servelab.interfaces import Draft, DrafterContext, Sequence
from servelab.plugins.drafters.medusa_tree import best_tree, load_accuracy
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
        self.tree = None
        if self.options.tree_nodes:
            top_k = min(self.options.tree_top_k, target.vocab_size)
            self.tree = best_tree(load_accuracy(directory, k, top_k), self.options.tree_nodes)
            self._node_heads = torch.tensor(self.tree.heads, device=device)
            self._node_ranks = torch.tensor(self.tree.ranks, device=device)
            self._top_k = max(self.tree.ranks) + 1

    @property
    def proposes_trees(self) -> bool:
        return self.tree is not None

    def propose(self, seqs: Seq[Sequence], hidden_states: torch.Tensor | None = None) -> Mapping[str, list[int]]:
        if not seqs or hidden_states is None:
            return {}
        with torch.inference_mode():
            x = hidden_states.to(self.weight.dtype)  # [B, H]
            residual = torch.nn.functional.silu(torch.einsum("bh,koh->bko", x, self.weight) + self.bias)
            heads = x[:, None, :] + residual  # [B, k, H]
            logits = self.lm_head(heads.reshape(-1, heads.shape[-1])).view(len(seqs), self.k, -1)
            if self.tree is not None:
                top = logits.topk(self._top_k, dim=-1).indices  # [B, k, top_k]
                nodes = top[:, self._node_heads, self._node_ranks].tolist()  # [B, N]: each node's token
                parents = self.tree.parents
                proposals = {}
                for seq, tokens in zip(seqs, nodes):
                    room = max(0, self.max_model_len - seq.num_tokens)  # a prefix of the nodes is a tree
                    if room:
                        proposals[seq.request_id] = Draft(tokens[:room], parents=parents[:room])
                return proposals
            tokens = logits.argmax(dim=-1)
        drafts = tokens.tolist()
        return {seq.request_id: draft[: max(0, self.max_model_len - seq.num_tokens)]
                for seq, draft in zip(seqs, drafts)}

"""Training an EAGLE-style draft head for a checkpoint (servelab's `eagle` drafter).

    python examples/training/train_eagle_head.py --target builtin:tiny --out core/engine/model/assets/tiny
    python examples/training/train_eagle_head.py --target /path/to/hf-checkpoint --out /path/to/heads \\
        --layers 2,14,27 --steps 600 --threads 2

The recipe (EAGLE-3, scaled down to a CPU):

* **Target features**: the frozen target runs over windows of text; the head reads the
  residual stream after three of its decoder layers (low, middle, high; never the last,
  which servelab computes only for the rows it samples), fused by a linear layer.
* **Head**: one Llama decoder layer (servelab.plugins.drafters.eagle_head.EagleHead),
  initialised from the target's last layer and final norm where the shapes agree; its
  input is the fused feature and the next token's embedding (the target's own, frozen),
  its output feeds the target's LM head (frozen), or with `--draft-vocab N` its own LM head
  over the N most frequent tokens (EAGLE-3's reduced vocabulary: on a 49k-token model the
  full LM head would cost the drafter more than its layer).
* **Training-time test**: the head is unrolled `--depth` steps, each step reading its own
  previous output as drafting does (EagleHead.unrolled), with loss weight 0.8^step.
* **Targets**: the target's own next-token distribution at each position (soft labels,
  so the head learns what verification will accept), not the text's tokens.
* **Data**: the standard-library corpus the embedded models were trained on
  (train_builtin_models.py), windows of `--seq-len` tokens.

The head and `eagle_config.json` go to `--out`; servelab finds them in the target's
directory or through `[drafter] heads`. Progress goes to stdout; the validation top-1
agreement with the target per drafting depth is printed at the end and written to
`eagle_training.json`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_builtin_models import (Batches, TrainLlama, _schedule, corpus_documents, eval_windows,  # noqa: E402
                                  split_documents, token_stream)

from servelab.plugins.drafters.eagle_head import EagleHead, HeadConfig, save_head  # noqa: E402

STEP_WEIGHT = 0.8


def load_target(spec: str) -> tuple[TrainLlama, object, Path]:
    """The target as a training-mode Llama in float32 (tied embeddings), its tokenizer, its directory."""
    from safetensors.torch import load_file
    from tokenizers import Tokenizer

    from servelab.model.builtin import resolve

    path = resolve(spec) if spec.startswith("builtin:") else Path(spec)
    config = json.loads((path / "config.json").read_text())
    config.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])
    config.setdefault("tie_word_embeddings", True)
    if config.get("rope_theta") is None:  # newer transformers nest it under rope_parameters
        config["rope_theta"] = (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    model = TrainLlama(config)
    tensors = {}
    for file in sorted(path.glob("model*.safetensors")):  # not the drafters' heads beside it
        tensors.update({k: v.float() for k, v in load_file(str(file)).items()})
    tensors.pop("lm_head.weight", None)  # tied
    model.load_state_dict(tensors)
    model.requires_grad_(False).eval()
    return model, Tokenizer.from_file(str(path / "tokenizer.json")), path


@torch.no_grad()
def target_pass(target: TrainLlama, ids: torch.Tensor, layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Features [B, T, len(layers) * hidden] (the residual stream after each of `layers`)
    and the target's log-probabilities [B, T, vocab]."""
    t = ids.shape[1]
    freqs = torch.outer(torch.arange(t, dtype=torch.float32), target.inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    x = target.model.embed_tokens(ids)
    kept = []
    for i, layer in enumerate(target.model.layers):
        x = layer(x, cos, sin)
        if i in layers:
            kept.append(x)
    return torch.cat(kept, dim=-1), torch.log_softmax(target.lm_head(target.model.norm(x)), dim=-1)


def head_config(target: TrainLlama, layers: tuple[int, ...], draft_vocab_size: int) -> HeadConfig:
    c = target.config
    return HeadConfig(hidden_size=c["hidden_size"], num_heads=c["num_attention_heads"],
                      num_kv_heads=c["num_key_value_heads"], head_dim=c["head_dim"],
                      intermediate_size=c["intermediate_size"], feature_layers=layers,
                      rms_norm_eps=c["rms_norm_eps"], rope_theta=c.get("rope_theta", 10000.0),
                      draft_vocab_size=draft_vocab_size)


def head_log_probs(head: EagleHead, target: TrainLlama, h: torch.Tensor) -> torch.Tensor:
    """The head's log-probabilities over its draft vocabulary (every token without one)."""
    if head.config.draft_vocab_size:
        return torch.log_softmax(head.lm_head(head.out_norm(h)), dim=-1)
    return torch.log_softmax(target.lm_head(head.out_norm(h)), dim=-1)


def in_draft_vocab(head: EagleHead, target_logp: torch.Tensor) -> torch.Tensor:
    """The target's distribution over the head's draft vocabulary, renormalised."""
    p = target_logp.exp()
    if head.config.draft_vocab_size:
        p = p[..., head.draft_tokens]
        p = p / p.sum(-1, keepdim=True).clamp_min(1e-12)
    return p


def init_from_target(head: EagleHead, target: TrainLlama) -> None:
    """Start the head's layer as the target's last layer, its output norm as the final norm."""
    last = target.model.layers[-1]
    pairs = {"input_layernorm": last.input_layernorm, "q_proj": last.self_attn.q_proj,
             "k_proj": last.self_attn.k_proj, "v_proj": last.self_attn.v_proj, "o_proj": last.self_attn.o_proj,
             "post_attention_layernorm": last.post_attention_layernorm, "gate_proj": last.mlp.gate_proj,
             "up_proj": last.mlp.up_proj, "down_proj": last.mlp.down_proj, "out_norm": target.model.norm}
    with torch.no_grad():
        for name, source in pairs.items():
            getattr(head, name).weight.copy_(source.weight)


def step_losses(head: EagleHead, target: TrainLlama, batch: torch.Tensor, depth: int) -> list[torch.Tensor]:
    """Per unrolled step: cross-entropy of the head against the target's distribution.
    Row t of step j predicts the token at t + 2 + j, whose distribution the target gives at t + 1 + j."""
    features, target_logp = target_pass(target, batch, head.config.feature_layers)
    n = batch.shape[1] - depth
    outputs = head.unrolled(head.fused(features[:, :n]), target.model.embed_tokens(batch[:, 1: n + depth]), depth)
    losses = []
    for step, h in enumerate(outputs):
        soft = in_draft_vocab(head, target_logp[:, 1 + step: 1 + step + n])
        losses.append(-(soft * head_log_probs(head, target, h)).sum(-1).mean())
    return losses


@torch.no_grad()
def agreement(head: EagleHead, target: TrainLlama, windows: torch.Tensor, depth: int) -> list[float]:
    """Validation: how often the head's top-1 at each depth equals the target's top-1
    (with the earlier depths' inputs the target's own tokens, as a chain draft sees them
    when its earlier drafts were accepted)."""
    correct, count = [0] * depth, [0] * depth
    for chunk in windows.split(8):
        features, target_logp = target_pass(target, chunk, head.config.feature_layers)
        n = chunk.shape[1] - depth
        outputs = head.unrolled(head.fused(features[:, :n]), target.model.embed_tokens(chunk[:, 1: n + depth]), depth)
        for step, h in enumerate(outputs):
            guess = head_log_probs(head, target, h).argmax(-1)
            if head.config.draft_vocab_size:
                guess = head.draft_tokens[guess]
            correct[step] += (guess == target_logp[:, 1 + step: 1 + step + n].argmax(-1)).sum().item()
            count[step] += guess.numel()
    return [c / n for c, n in zip(correct, count)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python examples/training/train_eagle_head.py",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="builtin:tiny", help="builtin:<name> or an HF checkpoint directory")
    parser.add_argument("--out", required=True, help="directory to write eagle.safetensors and eagle_config.json into")
    parser.add_argument("--layers", default="", help="comma-separated decoder layers to read (default: 2, L/2, "
                                                     "L-3; on fewer than 8 layers the three below the last)")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--depth", type=int, default=4, help="unrolled drafting steps (training-time test)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--draft-vocab", type=int, default=0,
                        help="EAGLE-3's reduced draft vocabulary: the head gets its own LM head over this many "
                             "most frequent tokens (0: the target's LM head over every token)")
    parser.add_argument("--max-chars", type=int, default=None, help="cap on the corpus (quick runs)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16", help="stored weights' dtype")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    target, tokenizer, _ = load_target(args.target)
    num_layers = target.config["num_hidden_layers"]
    # EAGLE-3's choice, low / middle / high: layers 2, L/2 and L-3; the three below the last on a shallow model.
    default = (2, num_layers // 2, num_layers - 3) if num_layers >= 8 else tuple(range(max(0, num_layers - 4),
                                                                                        num_layers - 1))
    layers = tuple(int(x) for x in args.layers.split(",")) if args.layers else default
    if max(layers) >= num_layers - 1:
        parser.error(f"--layers must lie below the last layer ({num_layers - 1})")
    train_docs, val_docs = split_documents(corpus_documents(args.max_chars))
    train, val = token_stream(tokenizer, train_docs), token_stream(tokenizer, val_docs)
    vocab = target.config["vocab_size"]
    draft_vocab = args.draft_vocab if 0 < args.draft_vocab < vocab else 0
    head = EagleHead(head_config(target, layers, draft_vocab))
    init_from_target(head, target)
    if draft_vocab:  # the most frequent tokens of the training text, and the target's output rows for them
        counts = torch.bincount(train, minlength=vocab)
        tokens = counts.topk(draft_vocab).indices.sort().values
        with torch.no_grad():
            head.draft_tokens.copy_(tokens)
            head.lm_head.weight.copy_(target.model.embed_tokens.weight[tokens])
        print(f"[eagle] draft vocabulary: {draft_vocab} of {vocab} tokens, covering "
              f"{counts[tokens].sum().item() / counts.sum().item():.1%} of the training text", flush=True)
    optimizer = torch.optim.AdamW(head.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    batches = Batches(train, args.seq_len, args.batch_size, args.seed + 301)
    windows = eval_windows(val, args.seq_len, 32)
    print(f"[eagle] layers {layers} of {num_layers}, {sum(p.numel() for p in head.parameters()):,} parameters, "
          f"{args.steps} steps of {args.batch_size} x {args.seq_len} tokens, depth {args.depth}", flush=True)
    start = time.perf_counter()
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = _schedule(step, args.steps, max(1, args.steps // 20), args.lr)
        losses = step_losses(head, target, batches.next(), args.depth)
        loss = sum(STEP_WEIGHT ** j * x for j, x in enumerate(losses))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optimizer.step()
        if (step + 1) % 20 == 0 or step + 1 == args.steps:
            print(f"[eagle] step {step + 1}/{args.steps} losses " + " ".join(f"{x.item():.3f}" for x in losses)
                  + f" {time.perf_counter() - start:.0f}s", flush=True)
    with torch.no_grad():  # what is stored is what serves
        for param in head.parameters():
            param.copy_(param.to(getattr(torch, args.dtype)).float())
    accuracy = agreement(head, target, windows, args.depth)
    print("[eagle] val top-1 agreement with the target per depth: " + " ".join(f"{a:.3f}" for a in accuracy))
    out = Path(args.out)
    save_head(head, out, getattr(torch, args.dtype))
    (out / "eagle_training.json").write_text(json.dumps(
        {"target": args.target, "layers": list(layers), "steps": args.steps, "depth": args.depth,
         "batch_size": args.batch_size, "seq_len": args.seq_len, "lr": args.lr, "seed": args.seed,
         "draft_vocab": draft_vocab,
         "seconds": round(time.perf_counter() - start, 1), "val_top1_agreement": [round(a, 4) for a in accuracy],
         "python": sys.version.split()[0], "torch": torch.__version__}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

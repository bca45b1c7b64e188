"""Training the embedded models: `builtin:tiny`, `builtin:tiny-draft` and tiny's Medusa heads.

    python examples/training/train_builtin_models.py --out core/engine/model/assets   # the shipped assets
    python examples/training/train_builtin_models.py --out /tmp/x --target-steps 20    # a quick look

Everything is trained on the CPU in plain torch (no `transformers` needed) from text that
ships with Python itself, so the assets are reproducible from the interpreter alone:

* **Corpus**: the documentation topics in `pydoc_data.topics` plus the source files of a
  fixed list of standard-library modules (`CORPUS_MODULES`, read from
  `sysconfig.get_paths()["stdlib"]`; the shipped assets come from CPython 3.11.7). Documents
  are sorted by name; every `VAL_EVERY`-th one is held out for validation.
* **Tokenizer**: byte-level BPE (`servelab.model.builtin.train_tokenizer`) trained on the
  training documents; `<unk>`=0, `<s>`=1, `</s>`=2, and `<s>` is prepended to each prompt.
  In training every document is `<s> text </s>`, concatenated into one token stream.
* **Models**: Llama (RMSNorm, RoPE, GQA, SwiGLU, tied embeddings) in the Hugging Face layout
  and names, trained on random windows of the stream with AdamW and a cosine schedule,
  stored as bfloat16 safetensors (servelab and `transformers` load them into float32).
* **Medusa heads** (Medusa-1): K residual blocks on the frozen target's final-normed hidden
  state x at position t; head i (0-based) predicts token t+2+i through the target's own
  (tied, frozen) LM head: `logits_i = lm_head(x + silu(W_i x + b_i))`. Shipped as
  `medusa.safetensors` (`medusa_heads.{i}.weight` [hidden, hidden] applied as
  `x @ W_i.T`, `medusa_heads.{i}.bias` [hidden]) and `medusa_config.json`.

Seeds are fixed (`--seed`, default 0) and training runs single-threaded, so a rerun on the
same machine reproduces the assets. Progress is printed to stdout; nothing here configures
logging.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import nn
from torch.nn import functional as F

BOS, EOS = 1, 2
VAL_EVERY = 16  # every 16th document (sorted by name) is held out

# Pure-Python standard-library modules whose source files join the corpus (paths relative
# to the stdlib directory, without ".py").
CORPUS_MODULES = (
    "argparse", "ast", "base64", "bisect", "calendar", "cmd", "code", "codecs", "colorsys",
    "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime", "difflib", "enum",
    "filecmp", "fileinput", "fnmatch", "fractions", "functools", "getopt", "gettext", "glob",
    "graphlib", "gzip", "hashlib", "heapq", "hmac", "ipaddress", "keyword", "linecache",
    "numbers", "operator", "optparse", "os", "pathlib", "posixpath", "pprint", "queue",
    "random", "reprlib", "sched", "secrets", "selectors", "shlex", "shutil", "statistics",
    "string", "textwrap", "threading", "timeit", "tokenize", "traceback", "types", "typing",
    "uuid", "warnings", "weakref", "json/__init__", "json/decoder", "json/encoder",
    "collections/__init__", "logging/__init__", "email/utils", "urllib/parse", "html/__init__",
    "http/cookies", "inspect", "pickle", "subprocess", "tarfile", "doctest", "pydoc", "mailbox",
    "locale", "socket", "smtplib", "ftplib", "platform", "tempfile", "trace", "bdb", "pdb",
    "pstats", "profile", "dis", "imaplib", "ssl", "socketserver", "webbrowser", "plistlib",
    "modulefinder", "pkgutil", "runpy", "quopri", "stat",
)

TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 4096,
    "hidden_size": 192,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 3,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": BOS,
    "eos_token_id": EOS,
    "torch_dtype": "bfloat16",
}
TINY_DRAFT_CONFIG = {
    **TINY_CONFIG,
    "hidden_size": 64,
    "intermediate_size": 192,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
}


@attrs.frozen(kw_only=True)
class TrainSettings:
    """What one run trains; the defaults are the shipped assets'."""

    target: dict = attrs.field(factory=lambda: dict(TINY_CONFIG))
    draft: dict = attrs.field(factory=lambda: dict(TINY_DRAFT_CONFIG))
    vocab_size: int = 4096
    seq_len: int = 256
    batch_size: int = 16
    target_steps: int = 1200
    draft_steps: int = 1000
    medusa_steps: int = 300
    medusa_heads: int = 3
    # Copy tuning: after pre-training, target and draft continue on windows of which this
    # fraction repeat a passage (lead-in, passage, passage again). That teaches copying
    # (induction), which "rewrite this passage" prompts need and which the corpus alone
    # did not teach at this scale (a 25% mix during pre-training did not either).
    copy_fraction: float = 0.0  # during pre-training
    copy_tune_steps: int = 400
    copy_tune_fraction: float = 0.5
    copy_tune_lr: float = 3e-3
    medusa_copy_fraction: float = 0.25
    lr: float = 2e-3
    medusa_lr: float = 1e-2
    warmup: int = 50
    weight_decay: float = 0.1
    eval_windows: int = 64  # validation windows of seq_len tokens
    max_chars: int | None = None  # cap on corpus size (for quick runs and tests)
    seed: int = 0
    log_every: int = 10
    dtype: str = "bfloat16"  # stored weights


# ------------------------------------------------------------------------------------ corpus


def corpus_documents(max_chars: int | None = None) -> list[tuple[str, str]]:
    """(name, text) for every corpus document, sorted by name."""
    from pydoc_data.topics import topics

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs = [(f"topic:{key}", topics[key]) for key in topics]
    for module in CORPUS_MODULES:
        file = stdlib / f"{module}.py"
        if not file.is_file():
            raise FileNotFoundError(f"corpus module {module!r} not found at {file} (this Python lacks it)")
        docs.append((f"module:{module}", file.read_text(encoding="utf-8")))
    docs.sort()
    if max_chars is not None:  # the head of every document, about max_chars in all
        docs = [(name, text[: max(1, max_chars // len(docs))]) for name, text in docs]
    return docs


def split_documents(docs: list[tuple[str, str]]) -> tuple[list[str], list[str]]:
    train = [text for i, (_, text) in enumerate(docs) if i % VAL_EVERY != VAL_EVERY // 2]
    val = [text for i, (_, text) in enumerate(docs) if i % VAL_EVERY == VAL_EVERY // 2]
    return train, val


def token_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """`<s> text </s>` per document, concatenated."""
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.extend([BOS, *encoding.ids, EOS])
    return torch.tensor(ids, dtype=torch.int64)


# ------------------------------------------------------------------------ training-mode Llama


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, c: dict) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        hidden = c["hidden_size"]
        self.q_proj = nn.Linear(hidden, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        # Query head h reads KV head h // (heads / kv_heads), as Hugging Face's repeat_kv.
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.heads != self.kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class MLP(nn.Module):
    def __init__(self, c: dict) -> None:
        super().__init__()
        hidden, inter = c["hidden_size"], c["intermediate_size"]
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c: dict) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.mlp = MLP(c)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, c: dict) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(Layer(c) for _ in range(c["num_hidden_layers"]))
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])


class TrainLlama(nn.Module):
    """A batched, cache-less Llama with tied embeddings whose state dict carries the
    Hugging Face names (`model.embed_tokens.weight`, `model.layers.0.self_attn.q_proj.weight`, ...)."""

    def __init__(self, config: dict) -> None:
        super().__init__()
        if not config.get("tie_word_embeddings"):
            raise ValueError("the training model ties its embeddings")
        self.config = config
        self.model = Decoder(config)
        d = config["head_dim"]
        inv_freq = 1.0 / (config["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def init_weights(self, generator: torch.Generator) -> None:
        std = 0.02
        residual_std = std / math.sqrt(2 * self.config["num_hidden_layers"])
        with torch.no_grad():
            for name, param in self.named_parameters():
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                elif name.endswith(("o_proj.weight", "down_proj.weight")):
                    param.normal_(0.0, residual_std, generator=generator)
                else:
                    param.normal_(0.0, std, generator=generator)

    def hidden_states(self, ids: torch.Tensor) -> torch.Tensor:
        """The final-normed hidden states [B, T, hidden] (what the LM head reads)."""
        t = ids.shape[1]
        freqs = torch.outer(torch.arange(t, dtype=torch.float32), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.model.norm(x)

    def lm_head(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.model.embed_tokens.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.hidden_states(ids))

    def hf_state_dict(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        return {name: tensor.detach().to(dtype).contiguous() for name, tensor in self.state_dict().items()}


class MedusaHeads(nn.Module):
    def __init__(self, num_heads: int, hidden: int) -> None:
        super().__init__()
        self.medusa_heads = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(num_heads))
        with torch.no_grad():  # start as the identity block: every head reads lm_head(x)
            for head in self.medusa_heads:
                head.weight.zero_()
                head.bias.zero_()

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [x + F.silu(head(x)) for head in self.medusa_heads]


def num_parameters(config: dict) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in TrainLlama(config).parameters())


# ---------------------------------------------------------------------------------- training


class Batches:
    """Seeded random windows of seq_len + 1 tokens from a token stream; a `copy_fraction`
    of them hold a passage followed by the same passage again."""

    def __init__(self, stream: torch.Tensor, seq_len: int, batch_size: int, seed: int,
                 copy_fraction: float = 0.0) -> None:
        if len(stream) < seq_len + 2:
            raise ValueError(f"corpus of {len(stream)} tokens is shorter than a window of {seq_len + 1}")
        self.stream, self.seq_len, self.batch_size = stream, seq_len, batch_size
        self.copy_fraction = copy_fraction
        self.generator = torch.Generator().manual_seed(seed)

    def next(self) -> torch.Tensor:
        width = self.seq_len + 1
        starts = torch.randint(0, len(self.stream) - width, (self.batch_size,), generator=self.generator)
        copies = torch.rand(self.batch_size, generator=self.generator) < self.copy_fraction
        # A copy window: `lead` tokens of context, a passage, and the passage again.
        leads = torch.randint(0, width // 4, (self.batch_size,), generator=self.generator)
        rows = []
        for start, copy, lead in zip(starts.tolist(), copies.tolist(), leads.tolist()):
            window = self.stream[start: start + width]
            if copy:
                passage = window[lead: lead + (width - lead + 1) // 2]
                window = torch.cat([window[:lead], passage, passage])[:width]
            rows.append(window)
        return torch.stack(rows)


def eval_windows(stream: torch.Tensor, seq_len: int, count: int) -> torch.Tensor:
    """Up to `count` evenly spaced windows of seq_len + 1 tokens (deterministic)."""
    usable = len(stream) - seq_len - 1
    if usable <= 0:
        raise ValueError(f"validation stream of {len(stream)} tokens is shorter than a window")
    count = max(1, min(count, usable // seq_len or 1))
    starts = [round(i * usable / max(1, count - 1)) if count > 1 else 0 for i in range(count)]
    return torch.stack([stream[s: s + seq_len + 1] for s in starts])


@torch.no_grad()
def evaluate(model: TrainLlama, windows: torch.Tensor, batch_size: int = 8) -> dict[str, float]:
    model.eval()
    total, correct, count = 0.0, 0, 0
    for chunk in windows.split(batch_size):
        logits = model(chunk[:, :-1])
        targets = chunk[:, 1:]
        total += F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum").item()
        correct += (logits.argmax(-1) == targets).sum().item()
        count += targets.numel()
    model.train()
    return {"loss": total / count, "top1": correct / count}


@torch.no_grad()
def copy_accuracy(model: TrainLlama, windows: torch.Tensor, batch_size: int = 8) -> float:
    """Top-1 accuracy on the second copy of held-out passages (each window's first half twice)."""
    model.eval()
    half = windows.shape[1] // 2
    doubled = torch.cat([windows[:, :half], windows[:, :half]], dim=1)
    correct = count = 0
    for chunk in doubled.split(batch_size):
        predicted = model(chunk[:, :-1]).argmax(-1)[:, half:]
        correct += (predicted == chunk[:, half + 1:]).sum().item()
        count += predicted.numel()
    model.train()
    return correct / count


def _schedule(step: int, steps: int, warmup: int, lr: float) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _optimizer(params: list[tuple[str, nn.Parameter]], lr: float, weight_decay: float) -> torch.optim.AdamW:
    decay = [p for n, p in params if p.dim() == 2 and "embed_tokens" not in n]
    rest = [p for n, p in params if not (p.dim() == 2 and "embed_tokens" not in n)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95), eps=1e-8)


def _language_model_step(model: TrainLlama, optimizer: torch.optim.Optimizer, batches: Batches, step: int,
                         steps: int, warmup: int, peak_lr: float) -> tuple[float, torch.Tensor]:
    """One next-token step at the scheduled learning rate; returns (lr, loss)."""
    lr = _schedule(step, steps, min(warmup, max(1, steps // 10)), peak_lr)
    for group in optimizer.param_groups:
        group["lr"] = lr
    batch = batches.next()
    loss = F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return lr, loss


def train_model(name: str, config: dict, train: torch.Tensor, val: torch.Tensor, s: TrainSettings,
                steps: int, seed: int, log=print) -> tuple[TrainLlama, dict[str, Any]]:
    torch.manual_seed(seed)
    model = TrainLlama(config)
    model.init_weights(torch.Generator().manual_seed(seed))
    optimizer = _optimizer(list(model.named_parameters()), s.lr, s.weight_decay)
    batches = Batches(train, s.seq_len, s.batch_size, seed + 1, s.copy_fraction)
    windows = eval_windows(val, s.seq_len, s.eval_windows)
    log(f"[{name}] {num_parameters(config):,} parameters, {steps} steps of {s.batch_size}x{s.seq_len} tokens")
    start, smoothed, history = time.perf_counter(), None, []
    for step in range(steps):
        lr, loss = _language_model_step(model, optimizer, batches, step, steps, s.warmup, s.lr)
        smoothed = loss.item() if smoothed is None else 0.9 * smoothed + 0.1 * loss.item()
        if (step + 1) % s.log_every == 0 or step + 1 == steps:
            elapsed = time.perf_counter() - start
            tokens = (step + 1) * s.batch_size * s.seq_len
            log(f"[{name}] step {step + 1}/{steps} loss {loss.item():.3f} (ema {smoothed:.3f}) "
                f"lr {lr:.2e} {tokens / elapsed:,.0f} tok/s {elapsed:.0f}s")
            history.append({"step": step + 1, "loss": round(loss.item(), 4)})
    train_metrics = evaluate(model, eval_windows(train, s.seq_len, s.eval_windows))
    unrounded = evaluate(model, windows)
    # What ships is the model rounded to the stored dtype: evaluate that.
    _round_to(model, s.dtype)
    val_metrics = evaluate(model, windows)
    copy_top1 = copy_accuracy(model, windows)
    result = {"parameters": num_parameters(config), "steps": steps,
              "tokens_seen": steps * s.batch_size * s.seq_len, "seconds": round(time.perf_counter() - start, 1),
              "final_train_loss_ema": round(smoothed, 4), "train_eval_loss": round(train_metrics["loss"], 4),
              "val_loss_float32": round(unrounded["loss"], 4), "val_loss": round(val_metrics["loss"], 4), "val_top1": round(val_metrics["top1"], 4),
              "val_copy_top1": round(copy_top1, 4),
              "history": history}
    log(f"[{name}] done: train loss {train_metrics['loss']:.3f}, val loss {val_metrics['loss']:.3f} "
        f"(ppl {math.exp(val_metrics['loss']):.1f}), val top-1 {val_metrics['top1']:.3f}, "
        f"top-1 on the repeated half of held-out passages {copy_top1:.3f}")
    return model, result


def copy_tune(name: str, model: TrainLlama, train: torch.Tensor, val: torch.Tensor, s: TrainSettings,
              seed: int, log=print) -> dict[str, Any]:
    """Continue training on windows of which `copy_tune_fraction` repeat a passage; the
    model ends rounded to the stored dtype, like `train_model`'s."""
    windows = eval_windows(val, s.seq_len, s.eval_windows)
    before = copy_accuracy(model, windows)
    optimizer = _optimizer(list(model.named_parameters()), s.copy_tune_lr, s.weight_decay)
    batches = Batches(train, s.seq_len, s.batch_size, seed + 301, s.copy_tune_fraction)
    start = time.perf_counter()
    for step in range(s.copy_tune_steps):
        _, loss = _language_model_step(model, optimizer, batches, step, s.copy_tune_steps, s.warmup, s.copy_tune_lr)
        if (step + 1) % s.log_every == 0 or step + 1 == s.copy_tune_steps:
            log(f"[{name} copy-tune] step {step + 1}/{s.copy_tune_steps} loss {loss.item():.3f} "
                f"{time.perf_counter() - start:.0f}s")
    _round_to(model, s.dtype)
    after = evaluate(model, windows)
    result = {"steps": s.copy_tune_steps, "fraction": s.copy_tune_fraction, "lr": s.copy_tune_lr,
              "copy_top1_before": round(before, 4), "copy_top1": round(copy_accuracy(model, windows), 4),
              "val_loss": round(after["loss"], 4), "val_top1": round(after["top1"], 4),
              "seconds": round(time.perf_counter() - start, 1)}
    log(f"[{name} copy-tune] done: top-1 on repeated held-out passages {result['copy_top1_before']:.3f} -> "
        f"{result['copy_top1']:.3f}; val loss {result['val_loss']:.3f}, top-1 {result['val_top1']:.3f}")
    return result


def _round_to(model: nn.Module, dtype: str) -> None:
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.to(getattr(torch, dtype)).float())


def medusa_logits(target: TrainLlama, heads: MedusaHeads, ids: torch.Tensor) -> list[torch.Tensor]:
    with torch.no_grad():
        x = target.hidden_states(ids)
    return [target.lm_head(h) for h in heads(x)]


def medusa_accuracy(target: TrainLlama, heads: MedusaHeads, windows: torch.Tensor, batch_size: int = 8) -> list[float]:
    """Top-1 accuracy of head i at predicting token t+2+i, over the validation windows."""
    k = len(heads.medusa_heads)
    correct, count = [0] * k, [0] * k
    with torch.no_grad():
        for chunk in windows.split(batch_size):
            for i, logits in enumerate(medusa_logits(target, heads, chunk)):
                shift = i + 2
                pred = logits[:, :-shift].argmax(-1)
                correct[i] += (pred == chunk[:, shift:]).sum().item()
                count[i] += pred.numel()
    return [c / n for c, n in zip(correct, count)]


def train_medusa(target: TrainLlama, train: torch.Tensor, val: torch.Tensor, s: TrainSettings,
                 log=print) -> tuple[MedusaHeads, dict[str, Any]]:
    torch.manual_seed(s.seed + 200)
    for param in target.parameters():
        param.requires_grad_(False)
    target.eval()
    k, hidden = s.medusa_heads, target.config["hidden_size"]
    heads = MedusaHeads(k, hidden)
    optimizer = torch.optim.AdamW(heads.parameters(), lr=s.medusa_lr, betas=(0.9, 0.95), weight_decay=0.0)
    batches = Batches(train, s.seq_len, s.batch_size, s.seed + 201, s.medusa_copy_fraction)
    windows = eval_windows(val, s.seq_len, s.eval_windows)
    log(f"[medusa] {k} heads, {sum(p.numel() for p in heads.parameters()):,} parameters, {s.medusa_steps} steps")
    start = time.perf_counter()
    for step in range(s.medusa_steps):
        lr = _schedule(step, s.medusa_steps, min(s.warmup, max(1, s.medusa_steps // 10)), s.medusa_lr)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = batches.next()
        losses = []
        for i, logits in enumerate(medusa_logits(target, heads, batch)):
            shift = i + 2
            losses.append(F.cross_entropy(logits[:, :-shift].flatten(0, 1), batch[:, shift:].flatten()))
        loss = sum(losses) / k
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if (step + 1) % s.log_every == 0 or step + 1 == s.medusa_steps:
            log(f"[medusa] step {step + 1}/{s.medusa_steps} losses "
                + " ".join(f"{x.item():.3f}" for x in losses) + f" {time.perf_counter() - start:.0f}s")
    _round_to(heads, s.dtype)
    accuracy = medusa_accuracy(target, heads, windows)
    log("[medusa] val top-1 accuracy per head (token t+2, t+3, ...): " + " ".join(f"{a:.3f}" for a in accuracy))
    return heads, {"num_heads": k, "steps": s.medusa_steps, "seconds": round(time.perf_counter() - start, 1),
                   "val_top1": [round(a, 4) for a in accuracy]}


# ----------------------------------------------------------------------------------- export


def save_checkpoint(model: TrainLlama, tokenizer, path: Path, dtype: str) -> None:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**model.config, "torch_dtype": dtype}, indent=2) + "\n")
    save_file(model.hf_state_dict(getattr(torch, dtype)), str(path / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save(str(path / "tokenizer.json"))


def save_medusa(heads: MedusaHeads, path: Path, dtype: str) -> None:
    from safetensors.torch import save_file

    tensors = {name: t.detach().to(getattr(torch, dtype)).contiguous() for name, t in heads.state_dict().items()}
    save_file(tensors, str(path / "medusa.safetensors"), metadata={"format": "pt"})
    config = {"num_heads": len(heads.medusa_heads), "hidden_size": heads.medusa_heads[0].weight.shape[0]}
    (path / "medusa_config.json").write_text(json.dumps(config, indent=2) + "\n")


@torch.no_grad()
def greedy(model: TrainLlama, tokenizer, prompt: str, max_tokens: int = 40) -> str:
    ids = tokenizer.encode(prompt).ids  # with <s>
    out: list[int] = []
    for _ in range(max_tokens):
        token = int(model(torch.tensor([ids + out]))[0, -1].argmax())
        if token == EOS:
            break
        out.append(token)
    return tokenizer.decode(out)


SAMPLE_PROMPTS = ("def fibonacci(n):", "import os", "The with statement", "class Stack:\n    def push(self, item):")


def train_all(out: Path, s: TrainSettings, log=print) -> dict[str, Any]:
    """Train the tokenizer, target, draft and Medusa heads; write `out/tiny`, `out/tiny-draft`
    and `out/training_log.json`. Returns the metrics."""
    from servelab.model.builtin import train_tokenizer

    torch.manual_seed(s.seed)
    docs = corpus_documents(s.max_chars)
    train_docs, val_docs = split_documents(docs)
    log(f"corpus: {len(docs)} documents, {sum(len(t) for _, t in docs):,} characters "
        f"({len(val_docs)} held out, {sum(map(len, val_docs)):,} characters); Python {sys.version.split()[0]}")
    tokenizer = train_tokenizer(s.vocab_size, train_docs)
    train, val = token_stream(tokenizer, train_docs), token_stream(tokenizer, val_docs)
    log(f"tokenizer: vocab {tokenizer.get_vocab_size()}; stream {len(train):,} train / {len(val):,} val tokens")
    for config in (s.target, s.draft):
        if config["vocab_size"] != tokenizer.get_vocab_size():
            raise ValueError(f"config vocab {config['vocab_size']} != tokenizer vocab {tokenizer.get_vocab_size()}")

    metrics: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__,
                               "settings": attrs.asdict(s), "corpus_documents": len(docs),
                               "corpus_characters": sum(len(t) for _, t in docs),
                               "train_tokens": len(train), "val_tokens": len(val)}
    target, metrics["tiny"] = train_model("tiny", s.target, train, val, s, s.target_steps, s.seed, log)
    metrics["tiny"]["copy_tune"] = copy_tune("tiny", target, train, val, s, s.seed, log)
    save_checkpoint(target, tokenizer, out / "tiny", s.dtype)
    heads, metrics["medusa"] = train_medusa(target, train, val, s, log)
    save_medusa(heads, out / "tiny", s.dtype)
    draft, metrics["tiny-draft"] = train_model("tiny-draft", s.draft, train, val, s, s.draft_steps, s.seed + 100, log)
    metrics["tiny-draft"]["copy_tune"] = copy_tune("tiny-draft", draft, train, val, s, s.seed + 100, log)
    save_checkpoint(draft, tokenizer, out / "tiny-draft", s.dtype)
    metrics["samples"] = {name: {p: greedy(model, tokenizer, p) for p in SAMPLE_PROMPTS}
                          for name, model in (("tiny", target), ("tiny-draft", draft))}
    for name, samples in metrics["samples"].items():
        for prompt, text in samples.items():
            log(f"[{name}] {prompt!r} -> {text!r}")
    (out / "training_log.json").write_text(json.dumps(metrics, indent=2) + "\n")
    return metrics


def _load_stored(out: Path, name: str, s: TrainSettings):
    """The stored (dtype-rounded) model `out/<name>` in float32, its tokenizer, and the
    corpus's train and validation streams."""
    from safetensors.torch import load_file
    from tokenizers import Tokenizer

    path = out / name
    model = TrainLlama(json.loads((path / "config.json").read_text()))
    model.load_state_dict({k: v.float() for k, v in load_file(str(path / "model.safetensors")).items()})
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    train_docs, val_docs = split_documents(corpus_documents(s.max_chars))
    return model, tokenizer, token_stream(tokenizer, train_docs), token_stream(tokenizer, val_docs)


def _update_log(out: Path, update) -> dict[str, Any]:
    """Apply `update(metrics)` to out/training_log.json (created if missing)."""
    log_path = out / "training_log.json"
    metrics = json.loads(log_path.read_text()) if log_path.is_file() else {}
    update(metrics)
    log_path.write_text(json.dumps(metrics, indent=2) + "\n")
    return metrics


def retrain_medusa(out: Path, s: TrainSettings, log=print) -> dict[str, Any]:
    """Train only the Medusa heads, on the (stored, so bfloat16-rounded) target in `out/tiny`.
    With the same settings this reproduces what `train_all` writes: the heads' seeds do not
    depend on the other stages."""
    target, _, train, val = _load_stored(out, "tiny", s)
    heads, result = train_medusa(target, train, val, s, log)
    save_medusa(heads, out / "tiny", s.dtype)

    def update(metrics: dict[str, Any]) -> None:
        metrics["medusa"] = result
        metrics.setdefault("settings", {}).update(medusa_steps=s.medusa_steps, medusa_lr=s.medusa_lr)

    return _update_log(out, update)


def retune_copying(out: Path, s: TrainSettings, name: str, seed: int, log=print) -> dict[str, Any]:
    """Copy-tune the stored model `out/<name>` in place (the stage `train_all` runs after
    pre-training; the stored weights are the pre-trained ones rounded to the stored dtype,
    which is what `train_all` tunes too)."""
    model, tokenizer, train, val = _load_stored(out, name, s)
    result = copy_tune(name, model, train, val, s, seed, log)
    save_checkpoint(model, tokenizer, out / name, s.dtype)
    return _update_log(out, lambda metrics: metrics.setdefault(name, {}).__setitem__("copy_tune", result))


def main(argv: list[str] | None = None) -> int:
    defaults = TrainSettings()
    parser = argparse.ArgumentParser(prog="python examples/training/train_builtin_models.py", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="directory to write tiny/ and tiny-draft/ into")
    parser.add_argument("--target-steps", type=int, default=defaults.target_steps)
    parser.add_argument("--draft-steps", type=int, default=defaults.draft_steps)
    parser.add_argument("--medusa-steps", type=int, default=defaults.medusa_steps)
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--seq-len", type=int, default=defaults.seq_len)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--medusa-lr", type=float, default=defaults.medusa_lr)
    parser.add_argument("--only", choices=("all", "medusa", "copy-tune-tiny", "copy-tune-draft"), default="all",
                        help="medusa: retrain only the heads, on the target already in OUT/tiny; "
                             "copy-tune-tiny / copy-tune-draft: only the copy-tuning stage of OUT/tiny or "
                             "OUT/tiny-draft (run copy-tune-tiny before medusa)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 reproduces the assets)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    settings = attrs.evolve(defaults, target_steps=args.target_steps, draft_steps=args.draft_steps,
                            medusa_steps=args.medusa_steps, batch_size=args.batch_size, seq_len=args.seq_len,
                            seed=args.seed, medusa_lr=args.medusa_lr)
    log = lambda line: print(line, flush=True)  # noqa: E731
    if args.only == "medusa":
        retrain_medusa(Path(args.out), settings, log)
    elif args.only == "copy-tune-tiny":
        retune_copying(Path(args.out), settings, "tiny", settings.seed, log)
    elif args.only == "copy-tune-draft":
        retune_copying(Path(args.out), settings, "tiny-draft", settings.seed + 100, log)
    else:
        train_all(Path(args.out), settings, log)
    return 0


if __name__ == "__main__":
    sys.exit(main())

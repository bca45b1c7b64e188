"""The top-k accuracy of builtin:tiny's Medusa heads, which `[drafter] tree_nodes` builds
its static token tree from (servelab.plugins.drafters.medusa_tree):

    OMP_NUM_THREADS=1 nice -n 19 python examples/measurements/medusa_accuracy.py

accuracy[h][r]: how often head h's rank-r token is the token the target itself produces
h + 1 places after the last one, on the target's own greedy continuations (what greedy
verification accepts) of held-out passages of its training corpus (every 16th document,
examples/training/train_builtin_models.py). Writes medusa_accuracy.json beside the heads.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import torch

from servelab import LLM, SamplingParams
from servelab.model.builtin import resolve

ROOT = Path(__file__).resolve().parents[2]


def held_out_passages(count: int, chars: int) -> list[str]:
    spec = importlib.util.spec_from_file_location("train", ROOT / "examples/training/train_builtin_models.py")
    training = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(training)
    _, val = training.split_documents(training.corpus_documents())
    step = max(1, sum(len(t) for t in val) // (count * chars))
    text = "".join(val)
    return [text[i * step * chars // 2: i * step * chars // 2 + chars].split(" ", 1)[-1] for i in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--passages", type=int, default=48)
    parser.add_argument("--prompt-chars", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=96, help="greedy tokens generated per passage")
    parser.add_argument("--top-k", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    directory = resolve("builtin:tiny")
    llm = LLM("builtin:tiny", max_model_len=512)
    prompts = held_out_passages(args.passages, args.prompt_chars)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True))

    import transformers
    from safetensors.torch import load_file

    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    config = json.loads((directory / "medusa_config.json").read_text())
    tensors = load_file(str(directory / "medusa.safetensors"))
    num_heads = config["num_heads"]
    hits = torch.zeros(num_heads, args.top_k)
    counted = torch.zeros(num_heads)
    with torch.inference_mode():
        for output in outputs:
            tokens = list(output.prompt_token_ids) + list(output.token_ids)
            first = len(output.prompt_token_ids)
            hidden = model(torch.tensor([tokens]), output_hidden_states=True).hidden_states[-1][0]  # final-normed
            # x at position t produced token t + 1; head h guesses token t + 2 + h. Positions
            # from the prompt's last on, so every guess is of a token the target generated.
            positions = torch.arange(first - 1, len(tokens) - 2)
            x = hidden[positions]
            for h in range(num_heads):
                targets = positions + 2 + h
                keep = targets < len(tokens)
                weight, bias = tensors[f"medusa_heads.{h}.weight"].float(), tensors[f"medusa_heads.{h}.bias"].float()
                logits = model.lm_head(x[keep] + torch.nn.functional.silu(x[keep] @ weight.T + bias))
                top = logits.topk(args.top_k, dim=-1).indices
                truth = torch.tensor(tokens)[targets[keep]]
                hits[h] += (top == truth[:, None]).float().sum(0)
                counted[h] += int(keep.sum())
    accuracy = (hits / counted[:, None]).tolist()
    result = {"top_k_accuracy": [[round(a, 4) for a in row] for row in accuracy],
              "positions": counted.int().tolist(),
              "measured_on": f"builtin:tiny's greedy continuations ({args.tokens} tokens) of {args.passages} held-out "
                             f"passages of its training corpus ({args.prompt_chars} characters each)",
              "command": "OMP_NUM_THREADS=1 python examples/measurements/medusa_accuracy.py"}
    (directory / "medusa_accuracy.json").write_text(json.dumps(result, indent=1) + "\n")
    for h, row in enumerate(accuracy):
        print(f"head {h} (token t+{h + 2}): " + " ".join(f"{a:.3f}" for a in row))
    print(f"wrote {directory / 'medusa_accuracy.json'}")


if __name__ == "__main__":
    main()

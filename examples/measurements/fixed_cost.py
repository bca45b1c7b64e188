"""What one stream's decode costs besides reading the weights: the model against a narrow
twin with its layer count and head counts (16-wide heads unless --twin-head-dim says, an
MLP of 96, 256 tokens: about 6 MB of fp32 weights, which stay in cache), batch-1 TPOT of
each, in fresh processes alternating round by round.

    python examples/measurements/fixed_cost.py --model ../peers/smollm2-hf --dtype bfloat16 --rounds 2
    python examples/measurements/fixed_cost.py --model smollm2-135m --weights int4 --rounds 2 --twin-head-dim 32

The twin runs every op the model runs (norms, rotary, the cache writes, attention, the
linears, the LM head, the engine's step around them) on next to no data, so its TPOT is
the part of the model's that is not bandwidth: the model's TPOT minus it, over the
weights' bytes, is the rate the weights actually stream at.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CHILD = r'''
import json, sys, tempfile
import torch, transformers
from servelab import LLM, SamplingParams
model, layers, heads, kv_heads, head_dim, settings = sys.argv[1], *map(int, sys.argv[2:6]), json.loads(sys.argv[6])
if model == "twin":
    config = transformers.LlamaConfig(hidden_size=head_dim * heads, intermediate_size=96, num_hidden_layers=layers,
                                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                                      vocab_size=256, max_position_embeddings=512, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = tempfile.mkdtemp()
    transformers.LlamaForCausalLM(config).save_pretrained(model)
llm = LLM(model, max_model_len=512, **settings)
shape = llm.engine.source.model_config
params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
tpot = []
for i in range(4):
    out = llm.generate([list(range(1, 129))], params)[0]
    if i:
        tpot.append((out.metrics.e2e_latency - out.metrics.ttft) / 63 * 1000)
print(json.dumps({"tpot_ms": sorted(tpot)[1], "shape": [shape.num_layers, shape.num_heads, shape.num_kv_heads]}))
'''


def run(model: str, shape: list[int], head_dim: int, settings: dict) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, model, *map(str, shape), str(head_dim), json.dumps(settings)],
                          capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default=None, help="the model's dtype (float32, bfloat16)")
    parser.add_argument("--weights", default=None, help="a weight format (int8, int4)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--twin-head-dim", type=int, default=16,
                        help="the twin's head width (32: every width a multiple of 32, as the quantized "
                             "kernels' blocks want; 16 pads each quantized call's input)")
    args = parser.parse_args()
    settings = {key: value for key, value in (("dtype", args.dtype), ("weights", args.weights)) if value}
    first = run(args.model, [0, 0, 0], args.twin_head_dim, settings)
    shape = first["shape"]
    times: dict[str, list[float]] = {"model": [first["tpot_ms"]], "twin": []}
    for round_index in range(args.rounds):
        for name in ("twin", "model") if round_index else ("twin",):
            times[name].append(run("twin" if name == "twin" else args.model, shape, args.twin_head_dim, settings)["tpot_ms"])
        print(f"round {round_index + 1}: " + ", ".join(f"{k} {v[-1]:.2f} ms" for k, v in times.items()),
              file=sys.stderr, flush=True)
    for name, values in times.items():
        print(f"{name:6} batch-1 TPOT {statistics.median(values):.2f} ms ({min(values):.2f}-{max(values):.2f}), "
              f"{len(values)} processes")
    print(f"layers, heads, KV heads: {shape}; settings: {settings or 'defaults'}")


if __name__ == "__main__":
    main()

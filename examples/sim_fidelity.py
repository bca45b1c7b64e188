"""Run TensorRT-LLM's published Llama-3.1-8B tables through `servelab bench --sim` and
print simulated / published for every row (see docs/bench.md, "Simulator fidelity").

    python examples/sim_fidelity.py                 # every row, a markdown table
    python examples/sim_fidelity.py --only h200     # rows whose GPU or workload matches
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("TQDM_DISABLE", "1")

from servelab.bench.sim.fidelity import compare, format_rows, references  # noqa: E402
from servelab.logging_setup import configure_logging  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="keep references whose 'GPU workload' label contains this text")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    configure_logging(0)
    selected = [r for r in references() if not args.only or args.only in f"{r.accelerator} {r.label}"]
    start = time.perf_counter()
    rows = compare(selected)
    print(format_rows(rows))
    ratios = [row["ratio"] for row in rows]
    print(f"\n{len(rows)} figures, sim / published from {min(ratios):.2f} to {max(ratios):.2f}, "
          f"{sum(0.8 <= r <= 1.2 for r in ratios)} within 20%; simulated in {time.perf_counter() - start:.0f} s")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)


if __name__ == "__main__":
    main()

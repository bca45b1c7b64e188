"""The simulator against TensorRT-LLM's published Llama-3.1-8B measurements: every
row of the reference tables, simulated with the same engine code, lands within 20%."""

from __future__ import annotations

import pytest

from servelab.bench.sim.fidelity import compare, references

TOLERANCE = 0.20  # every row of both tables is within this, throughput and latency alike

REFERENCES = list(references())
NAMES = [f"{r.accelerator}-{r.label}".replace(" ", "-") for r in REFERENCES]


@pytest.mark.parametrize("reference", REFERENCES, ids=NAMES)
def test_simulated_row_matches_published(reference):
    for row in compare([reference]):
        assert 1 - TOLERANCE <= row["ratio"] <= 1 + TOLERANCE, row


def test_latency_grows_with_load_as_published():
    online = [r for r in REFERENCES if r.accelerator == "h100" and r.label.startswith("online")]
    rows = {(row["label"], row["metric"]): row["simulated"] for row in compare(online)}
    ttft = [rows[(f"online {rate} req/s", "mean TTFT ms")] for rate in (2, 16, 32, "inf")]
    itl = [rows[(f"online {rate} req/s", "mean ITL ms")] for rate in (2, 16, 32, "inf")]
    assert ttft == sorted(ttft) and ttft[-1] > 50 * ttft[0]  # published: 23 -> 3,335 ms
    assert itl == sorted(itl) and itl[-1] > 3 * itl[0]  # published: 8 -> 39 ms

"""The simulator against TensorRT-LLM's published Llama-3.1-8B measurements: every
row of the reference tables, simulated with the same engine code, lands within 20%."""

from __future__ import annotations

import pytest

from servelab.bench.sim.fidelity import compare, references

TOLERANCE = 0.20  # every row of both tables is within this, throughput and latency alike

REFERENCES = list(references())
# The H100 online rows at rising rates: checked together below, for the growth of latency too.
RISING = [r for r in REFERENCES if r.accelerator == "h100" and r.label.startswith("online")]
SINGLE = [r for r in REFERENCES if r not in RISING]


def _within_tolerance(row):
    assert 1 - TOLERANCE <= row["ratio"] <= 1 + TOLERANCE, row


@pytest.mark.parametrize("reference", SINGLE, ids=[f"{r.accelerator}-{r.label}".replace(" ", "-") for r in SINGLE])
def test_simulated_row_matches_published(reference):
    for row in compare([reference]):
        _within_tolerance(row)


def test_online_rows_match_published_and_latency_grows_with_load_as_published():
    compared = compare(RISING)
    for row in compared:
        _within_tolerance(row)
    rows = {(row["label"], row["metric"]): row["simulated"] for row in compared}
    ttft = [rows[(f"online {rate} req/s", "mean TTFT ms")] for rate in (2, 16, 32, "inf")]
    itl = [rows[(f"online {rate} req/s", "mean ITL ms")] for rate in (2, 16, 32, "inf")]
    assert ttft == sorted(ttft) and ttft[-1] > 50 * ttft[0]  # published: 23 -> 3,335 ms
    assert itl == sorted(itl) and itl[-1] > 3 * itl[0]  # published: 8 -> 39 ms

"""TTFT per backend across prompt lengths and cached fractions: cold, engine hit, tier hit.

Each cell is one test; its rounds go through pytest-benchmark, and every request is checked against
vLLM's per-source cache counters, so a "hit" that came from the wrong place fails its cell.
"""


def test_ttft(kv_cell, kv_measure):
    outcome = kv_measure(kv_cell)
    assert len(outcome.results) >= 1

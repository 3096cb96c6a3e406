"""The host's copy rate: what a DRAM tier's limit reads its bytes at (analysis/tier_limit.py), measured by
the run on its own machine rather than assumed, since CPUs and their memory differ."""

from __future__ import annotations

import time

import numpy as np

from pytest_kvoffload.drive.rate import Rate


def host_copy(nbytes: int = 64 << 20, repeats: int = 5) -> Rate:
    """One thread copying `nbytes` between two buffers already touched, `repeats` passes: GB/s delivered
    (bytes copied over the pass's time), as a DRAM tier delivers a prefix to the engine's cache."""
    source = np.ones(max(1, nbytes), dtype=np.uint8)
    target = np.zeros_like(source)
    np.copyto(target, source)  # both buffers' pages in place before timing
    rates = []
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        np.copyto(target, source)
        rates.append(source.nbytes / (time.perf_counter() - start) / 1e9)
    return Rate.of(rates)


__all__ = ["host_copy"]

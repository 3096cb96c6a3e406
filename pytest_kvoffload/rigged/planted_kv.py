"""Wrong KV planted in a load (the test-only connector's option fault), as a bug would load it past the
store's checks: the output checks' proof that they see wrong KV."""

from __future__ import annotations

import torch


def planted(src: torch.Tensor, fault: str, nth: int) -> torch.Tensor:
    """Wrong KV for fault-injection tests (option fault), as a bug would load it past the
    store's checks: "zero", "shift" (each block gets its file's previous block; a one-block file's layers are
    rolled instead), or "alternate" (the `nth` load zero where odd, shift where even)."""
    if fault == "alternate":
        fault = "zero" if nth % 2 else "shift"
    return torch.zeros_like(src) if fault == "zero" else torch.roll(src, 1, dims=1 if src.shape[1] > 1 else 0)


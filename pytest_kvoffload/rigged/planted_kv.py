"""Wrong KV planted in a load (the test-only connector's option fault), as a bug would load it past the
store's checks: the output checks' proof that they see wrong KV."""

from __future__ import annotations

import torch


def planted(src: torch.Tensor, fault: str, nth: int) -> torch.Tensor:
    """Wrong KV for fault-injection tests (option fault), as a bug would load it past the
    store's checks: "zero", "shift" (each block gets its file's previous block; a one-block file's layers are
    rolled instead), or "alternate" (the `nth` load zero where odd, shift where even); "stale" is
    stale_block's."""
    if fault == "alternate":
        fault = "zero" if nth % 2 else "shift"
    return torch.zeros_like(src) if fault == "zero" else torch.roll(src, 1, dims=1 if src.shape[1] > 1 else 0)


def stale_block(src: torch.Tensor, position: int, earlier: torch.Tensor | None) -> torch.Tensor:
    """One block of a load's KV stale, the rest right (fault "stale": the subtle wrong KV an index or
    hashing bug gives): block `position` of the chunk replaced by `earlier`, a block kept from an earlier
    load of another prompt, or by the chunk's next block where there is none yet."""
    out = src.clone()
    if earlier is not None and earlier.shape == out[:, position:position + 1].shape:
        out[:, position:position + 1] = earlier
    else:
        out[:, position] = src[:, (position + 1) % src.shape[1]]
    return out

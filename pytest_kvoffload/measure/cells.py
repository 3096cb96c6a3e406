"""Cells of the grid and the three states a cell is measured in.

cold        a prompt no cache has seen: the recompute cost.
engine-hit  the prefix primed by an earlier request and still in the engine's own prefix cache.
tier-hit    the prefix primed, then evicted from the engine's cache (reset without reset_external),
            so it can only come from the backend's offload tier.

Every measurement is checked against vLLM's per-source counters: a cell that measured the wrong
thing fails with the numbers instead of producing a quietly wrong figure.
"""

from __future__ import annotations

from dataclasses import dataclass

from pytest_kvoffload.core.cell_state import State
from pytest_kvoffload.measure.prompts import expected_cached


@dataclass(frozen=True)
class Cell:
    length: int
    fraction: float  # the cached share of the prompt; 0 for cold cells
    state: State

    @property
    def id(self) -> str:
        if self.state is State.COLD:
            return f"{self.length}-cold"
        return f"{self.length}-f{self.fraction:g}-{self.state.value}"


def grid(lengths: tuple[int, ...], fractions: tuple[float, ...]) -> list[Cell]:
    """Cold once per length (the fraction does not change a cold prompt), hits per length and fraction."""
    cells = []
    for n in lengths:
        cells.append(Cell(n, 0.0, State.COLD))
        for f in fractions:
            cells.append(Cell(n, f, State.ENGINE_HIT))
            cells.append(Cell(n, f, State.TIER_HIT))
    return cells


@dataclass(frozen=True)
class Expectation:
    """Tokens each source must report for one measured request."""

    source: str | None  # None: nothing may be cached
    tokens: int
    # A tier's share beside the main source: the prompt's last block, which the engine's cache cannot
    # serve and vLLM's own offloading can (prompts.expected_cached's `last_block`).
    tail_source: str | None = None
    tail_tokens: int = 0

    def as_counted_by(self, release) -> "Expectation":
        """This expectation as a release counts it: where vLLM cannot name tiers (0.31), every tier's
        tokens are "external" (core/vllm_releases.py), a tail from the same place joined to the main part."""
        source, tail = release.coarse(self.source), release.coarse(self.tail_source)
        if tail is not None and tail == source:
            return Expectation(source, self.tokens + self.tail_tokens)
        return Expectation(source, self.tokens, tail, self.tail_tokens)

    def check(self, cached_by_source: dict[str, int]) -> str | None:
        """None when the counters match, else a message with the numbers."""
        total = sum(cached_by_source.values())
        if self.source is None:
            if total:
                return f"expected a cold request but {total} tokens came from cache {dict(cached_by_source)}"
            return None
        got = cached_by_source.get(self.source, 0)
        others = {s: n for s, n in cached_by_source.items() if s != self.source and n}
        tail = {self.tail_source: self.tail_tokens} if self.tail_tokens else {}
        if got != self.tokens or others != tail:
            expected_tail = f" and {self.tail_tokens} from {self.tail_source!r}" if tail else ""
            return (
                f"expected {self.tokens} cached tokens from {self.source!r}{expected_tail}, got {got}"
                + (f" and {others} from elsewhere" if others else "")
            )
        return None


def expectation(cell: Cell, prefix_tokens: int, block_size: int, tier: str | None, tier_granularity: int,
                last_block_source: str | None = None, all_but_last_token: bool = False) -> Expectation:
    """What a cell's measured request must report by source.

    `last_block_source`: the tier that serves a prompt's last block when the engine cannot (None: none
    does); it then joins an engine hit with that block and makes a tier hit cover it. `all_but_last_token`:
    that tier counts a whole prompt as all of its tokens but the last (prompts.expected_cached).
    """
    if cell.state is State.COLD:
        return Expectation(None, 0)
    if cell.state is State.ENGINE_HIT:
        device = expected_cached(prefix_tokens, cell.length, block_size)
        if last_block_source is None:
            return Expectation("device", device)
        tail = expected_cached(prefix_tokens, cell.length, block_size, tier_granularity, last_block=True,
                               all_but_last_token=all_but_last_token) - device
        return Expectation("device", device, last_block_source, tail) if tail > 0 else Expectation("device", device)
    if tier is None:
        raise ValueError("a tier-hit cell needs a backend with an offload tier")
    return Expectation(tier, expected_cached(prefix_tokens, cell.length, block_size, tier_granularity,
                                             last_block=last_block_source is not None,
                                             all_but_last_token=all_but_last_token))

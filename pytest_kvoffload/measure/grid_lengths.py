"""The grid's lengths: --kv-lengths as given, or the defaults whose cold prefill the first measured server
predicts within the prefill budget (--kv-max-prefill), decided once so that every backend runs the same grid."""

from __future__ import annotations

from pytest_kvoffload.core.settings import Settings
from pytest_kvoffload.measure.prefill_speed import PrefillSpeed


def lengths_within(lengths: tuple[int, ...], speed: PrefillSpeed, budget_s: float | None,
                   keep_at_least: int = 3) -> tuple[int, ...]:
    """The grid's lengths whose predicted cold prefill fits the budget; the shortest `keep_at_least`
    stay whatever they cost (the recompute fit needs three lengths)."""
    if budget_s is None:
        return lengths
    ordered = sorted(lengths)
    kept = [n for n in ordered if speed.predict(n) <= budget_s]
    return tuple(ordered[:max(len(kept), min(keep_at_least, len(ordered)))])


class GridLengths:
    """The one owner of the grid's lengths in a session."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.decided: tuple[int, ...] | None = None

    @property
    def lengths(self) -> tuple[int, ...]:
        return self.decided if self.decided is not None else self.settings.lengths

    def decide(self, speed: PrefillSpeed) -> str | None:
        """Fix the lengths from the first server's prefill speed; a line naming those left out, if any."""
        s = self.settings
        self.decided = s.lengths if s.lengths_given else lengths_within(s.lengths, speed, s.max_prefill_s)
        dropped = [n for n in s.lengths if n not in self.decided]
        if not dropped:
            return None
        return (f"lengths {', '.join(map(str, dropped))} left out: their cold prefill is predicted above the "
                f"{s.max_prefill_s:g} s budget on this machine ("
                + ", ".join(f"{n}: {speed.predict(n):.1f} s" for n in dropped)
                + "); --kv-lengths keeps them, --kv-max-prefill changes the budget")

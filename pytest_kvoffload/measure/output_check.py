"""The output check: a hit's greedy tokens and their logprobs against a recompute's, at every position.

Two computations of one prompt agree only up to rounding (bf16 keeps 8 bits of mantissa, and a hit computes
its suffix in other shapes than a cold prefill), so at each position the likeliest tokens' logprobs of the
hit and of the recompute may differ by up to core/tolerances.OUTPUT_NATS; wrong KV (one stale block is
enough) moves them further. Where the recompute's top two are within that of each other (a near-tie) the hit
may take either, and from there the two outputs continue from different tokens: comparing later positions
would mean nothing, so a second hit is sent whose prompt is the prompt plus the recompute's tokens up to the
tie, and the comparison goes on from its first token. Every check says how many positions it compared.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from pytest_kvoffload.core.tolerances import OUTPUT_NATS

# How many of the likeliest tokens come back with their logprobs. Seen in bf16: three tokens within
# 0.031 nats, the hit taking the third; two candidates could not see that tie.
TIE_CANDIDATES = 5


class Output(Protocol):
    output_token_ids: Sequence[int]
    top_logprobs: Sequence[dict[int, float]]


@dataclass(frozen=True)
class Tokens:
    """An output as plain lists (tests, recorded outputs)."""

    output_token_ids: Sequence[int]
    top_logprobs: Sequence[dict[int, float]] = ()


@dataclass(frozen=True)
class OutputCheck:
    compared: int                # positions compared (the recompute's output length when it ran to the end)
    of: int                      # the recompute's output tokens
    difference: str | None       # None: the outputs agree
    largest_nats: float = 0.0    # the largest logprob deviation seen between the two, over shared candidates
    continued: int = 0           # second hits sent past near-ties

    @property
    def matches(self) -> bool:
        return self.difference is None

    def record(self) -> dict:
        """The fields a measurement records."""
        out = {"output_matches": self.matches, "output_tokens_compared": self.compared,
               "output_logprob_deviation_nats": round(self.largest_nats, 4), "output_continued": self.continued}
        if self.difference:
            out["output_difference"] = self.difference
        return out


def _deviation(hit: dict[int, float], want: dict[int, float]) -> tuple[float, int | None]:
    """The largest |logprob difference| over tokens both list, and that token."""
    shared = [(abs(hit[t] - want[t]), t) for t in set(hit) & set(want)]
    return max(shared) if shared else (0.0, None)


def _mismatch(j: int, got: int, want: int, top: dict[int, float]) -> str:
    # How far off, so that a failure tells a near-tie just past the tolerance from KV that is wrong.
    where = (f" ({top[want] - top[got]:.3f} nats below it)" if got in top and want in top else
             f" (not among its {len(top)} likeliest)" if want in top else "")
    return f"output token {j}: {got} where a recompute gives {want}{where}"


def compare_outputs(got: Output, want: Output, continue_from: Callable[[list[int]], Output] | None = None,
                    tolerance: float = OUTPUT_NATS) -> OutputCheck:
    """`got` (a hit) against `want` (a recompute with its top logprobs) at every position; past a near-tie,
    `continue_from(want's tokens up to it)` gives the hit's continuation (None: the check stops there)."""
    ref, ref_top = list(want.output_token_ids), list(want.top_logprobs)
    ids, top, start = list(got.output_token_ids), list(got.top_logprobs), 0
    compared, largest, continued = 0, 0.0, 0

    def result(difference=None):
        return OutputCheck(compared, len(ref), difference, largest, continued)

    while True:
        tie = None
        for i, token in enumerate(ids[:max(0, len(ref) - start)]):
            j = start + i
            r = ref_top[j] if j < len(ref_top) else {}
            if token != ref[j] and not (token in r and ref[j] in r and r[ref[j]] - r[token] <= tolerance):
                return result(_mismatch(j, token, ref[j], r))
            deviation, which = _deviation(top[i] if i < len(top) else {}, r)
            largest = max(largest, deviation)
            if deviation > tolerance:
                return result(f"output token {j}: token {which}'s logprob {deviation:.3f} nats from a recompute's "
                              f"(at most {tolerance:g})")
            compared += 1
            if token != ref[j]:  # a near-tie: either token is right, and what follows the hit's means nothing
                tie = j
                break
        if tie is None:
            if start + len(ids) != len(ref):
                return result(f"{start + len(ids)} output tokens where a recompute gives {len(ref)}")
            return result()
        if continue_from is None or tie + 1 >= len(ref):
            return result()
        following = continue_from(ref[:tie + 1])
        continued += 1
        ids, top, start = list(following.output_token_ids), list(following.top_logprobs), tie + 1

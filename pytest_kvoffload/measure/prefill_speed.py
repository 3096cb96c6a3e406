"""A server's prefill speed, measured when it starts, and what the run derives from it.

Our CPUs differ by more than ten times (an AVX2-only EPYC computes tiny-llama's 4,096-token prefill in
7.4 s in float32, an AVX-512 machine in 0.8 s in bf16), so nothing here assumes a speed. Every server
gets warm-up requests (the first requests of a server pay one-time costs and must not land in a cell),
and those requests are timed: on the session's first server cold prompts of doubling length, 256 tokens
up to the grid's longest, stopping once one takes longer than the prefill budget; on later ones the grid's
longest alone. From them:

- the default grid keeps only the lengths whose cold prefill is predicted within the budget
  (`Settings.max_prefill_s`; lengths the user gave with --kv-lengths are always kept);
- the admission suite derives its slowed drive from the same kind of measurement (suite_machinery/admission/derived_drive.py);
- run.json records each backend's figures, so a reader sees whether engines were equal.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pytest_kvoffload.serve.client import Endpoint, stream_completion
from pytest_kvoffload.measure.prompts import make_prompt
from pytest_kvoffload.measure.output_check import TIE_CANDIDATES
from pytest_kvoffload.measure.runner import OUTPUT_TOKENS

FIRST_LENGTH = 256
WARMUP_REQUESTS = 2  # untimed: allocations, caches and the first forward's one-time costs
REPEATS = 2          # timed requests per length (the faster one counts: noise only ever adds time)


@dataclass
class PrefillSpeed:
    """Cold TTFT by prompt length, as measured on one server at its start."""

    points: list[tuple[int, float]] = field(default_factory=list)  # (tokens, seconds), increasing tokens

    def predict(self, tokens: int) -> float:
        """Seconds of cold prefill for `tokens`: measured where it was, extrapolated from the last two
        points by the power law they span (at least linear) beyond them."""
        if not self.points:
            raise ValueError("no prefill measured")
        lengths = [n for n, _ in self.points]
        times = [t for _, t in self.points]
        if tokens <= lengths[-1] or len(self.points) == 1:
            if len(self.points) == 1:
                return times[0] * max(1.0, tokens / lengths[0])
            return float(np.interp(tokens, lengths, times))
        (n1, t1), (n2, t2) = self.points[-2], self.points[-1]
        exponent = max(1.0, float(np.log(t2 / t1) / np.log(n2 / n1))) if t1 > 0 and t2 > t1 else 1.0
        return t2 * (tokens / n2) ** exponent

    def tokens_per_s(self) -> float:
        n, t = self.points[-1]
        return n / t

    def to_dict(self) -> dict:
        return {"points": [{"tokens": n, "seconds": t} for n, t in self.points],
                "tokens_per_s": self.tokens_per_s() if self.points else None}

    def describe(self) -> str:
        n, t = self.points[-1]
        return f"cold prefill {n:,} tokens in {t * 1e3:,.0f} ms ({n / t:,.0f} tokens/s)"


def probe_lengths(longest: int, max_model_len: int) -> list[int]:
    """256, 512, ... up to the grid's longest length (which is included), below the context length."""
    lengths, n = [], FIRST_LENGTH
    while n < longest:
        lengths.append(n)
        n *= 2
    lengths.append(longest)
    return [n for n in lengths if n < max_model_len]


def measure_prefill(endpoint: Endpoint, longest: int, max_model_len: int, budget_s: float | None,
                    salt: str, vocab_size: int, curve: bool = True) -> PrefillSpeed:
    """Warm the server up, then time cold prompts of doubling length until one exceeds `budget_s`.

    Without `curve`, only the longest is timed: a server started once the grid is fixed needs its warm-up
    and one figure to set beside the first server's, not the curve that chose the grid (make bench's
    seven warm-ups took 24 s against 36 on the 2-core VM)."""
    def fresh(n: int, tag: str) -> list[int]:
        return make_prompt(n, 0.0, salt=f"{salt}|prefill-speed|{tag}", vocab_size=vocab_size).tokens

    for i in range(WARMUP_REQUESTS):
        if i:
            # The output checks' path too: a server's first request with logprobs took 1.4 s where the next
            # took 0.23 (1,025 tokens, 2-core VM), and a cold request may be one (runner.CellRunner's prime).
            stream_completion(endpoint, fresh(FIRST_LENGTH, f"warmup{i}"), OUTPUT_TOKENS, logprobs=TIE_CANDIDATES)
        else:
            stream_completion(endpoint, fresh(FIRST_LENGTH, f"warmup{i}"))
    speed = PrefillSpeed()
    for n in probe_lengths(longest, max_model_len)[0 if curve else -1:]:
        seconds = min(stream_completion(endpoint, fresh(n, f"{n}|{r}")).client_ttft_s for r in range(REPEATS))
        speed.points.append((n, seconds))
        if budget_s is not None and seconds > budget_s:
            break
    return speed

"""One rate type for every drive probe (the drive alone, in bursts, the connector's own paths, fio): the
median of repeated passes and the lowest and highest pass, in GB/s. The drive here is noisy: a figure
without its spread would say more than was measured."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Rate:
    median: float = 0.0
    low: float = 0.0
    high: float = 0.0

    @classmethod
    def of(cls, samples) -> Rate:
        """From each pass's GB/s; Rate() (all 0: not measured) from none."""
        values = list(samples)
        return cls(statistics.median(values), min(values), max(values)) if values else cls()

    def __bool__(self) -> bool:
        return self.median > 0

    @property
    def range(self) -> tuple[float, float]:
        return self.low, self.high

    def describe(self) -> str:
        return f"{self.median:.2f} GB/s ({self.low:.2f} to {self.high:.2f})"


class Rates:
    """A probe result's rates read as they are recorded: `write_gbps` the median, `write_range` the (low,
    high) of the `write` Rate, and likewise `read` and `overwrite`; to_dict writes those flat keys (run.json
    keeps one layout for every probe)."""

    RATES = ("write", "read", "overwrite")

    def rate(self, name: str) -> Rate:
        return getattr(self, name, None) or Rate()

    write_gbps = property(lambda self: self.rate("write").median)
    write_range = property(lambda self: self.rate("write").range)
    read_gbps = property(lambda self: self.rate("read").median)
    read_range = property(lambda self: self.rate("read").range)
    overwrite_gbps = property(lambda self: self.rate("overwrite").median)
    overwrite_range = property(lambda self: self.rate("overwrite").range)

    def to_dict(self) -> dict:
        out = asdict(self)
        for name in self.RATES:
            if name in out:
                rate = out.pop(name)
                out[f"{name}_gbps"], out[f"{name}_range"] = rate["median"], (rate["low"], rate["high"])
        return out

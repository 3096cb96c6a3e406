"""The drive alone in the connector's own pattern, measured round by round beside the connector's rounds: the
reference the disk-speed suite holds the connector's delivered bandwidth to.

This VM's drive moves by a fifth within minutes (the connector's own load path alone read 1.28 GB/s, then
1.08 GB/s ten minutes later with the same code: docs/notes/2026-12-02-paired.md). A reference taken before or
after the rounds, however well it copies the pattern, then says as much about when it ran as about the
connector. So each of the connector's rounds (its cold request's saves, its tier hit's load) is followed at
once by raw requests of the same size in the same pattern, none of the store's code: the round's chunks
handed to the connector's number of threads at once, written into a fresh file, read back once in one
burst, and written over again (probe.probe_disk_bursts, one burst a way). Both figures are bytes over busy
time summed over the same rounds, so they cover the same minutes of the drive; the per-round figures give
the spread.

One burst of all the round's chunks is the connector's pattern when a prompt's prefill is one step (its
saves are one batch); where a prefill takes several steps the connector writes smaller batches, which a
drive serves no faster, so the reference can only be the harder one to match.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from pytest_kvoffload.drive.probe import BurstResult, probe_disk_bursts
from pytest_kvoffload.drive.rate import Rate

WAYS = ("write", "overwrite", "read")


@dataclass
class DriveBeside:
    """Raw bursts after each connector round (after_round), summed as the connector's counters sum its I/O."""
    folder: Path
    request_bytes: int  # a chunk file's bytes
    threads: int  # the connector's io_threads
    rounds: list[BurstResult] = field(default_factory=list)

    def after_round(self, chunks: int, idle_s: float) -> BurstResult:
        """The round's `chunks` chunk files' worth of raw requests, written, read and written over, each way
        one burst after `idle_s` of nothing (the drive's rest before the connector's saves)."""
        chunks = max(1, chunks)
        time.sleep(idle_s)
        result = probe_disk_bursts(self.folder, self.request_bytes, chunks, idle_s,
                                   total_bytes=chunks * self.request_bytes, repeats=1, threads=self.threads,
                                   read_burst=chunks)
        self.rounds.append(result)
        return result

    def gbps(self, way: str) -> float:
        """Bytes over busy seconds over every round (0 where none was measured)."""
        moved = busy = 0.0
        for r in self.rounds:
            rate = r.rate(way).median
            if rate:
                nbytes = r.burst * r.request_bytes
                moved += nbytes
                busy += nbytes / (rate * 1e9)
        return moved / busy / 1e9 if busy else 0.0

    def spread(self, way: str) -> Rate:
        return Rate.of(r.rate(way).median for r in self.rounds if r.rate(way))

    def write_reference(self, over_share: float) -> float:
        """The drive's write bandwidth for the connector's mix: `over_share` of the bytes written over old
        blocks, the rest into new ones (probe.write_reference's harmonic mix, of the summed figures)."""
        fresh, over = self.gbps("write"), self.gbps("overwrite")
        if not over or over_share <= 0:
            return fresh
        return 1.0 / (over_share / over + (1.0 - over_share) / fresh) if fresh else 0.0

    def to_dict(self) -> dict:
        out = {"rounds": len(self.rounds), "request_bytes": self.request_bytes, "threads": self.threads}
        for way in WAYS:
            spread = self.spread(way)
            out[f"{way}_gbps"], out[f"{way}_range"] = self.gbps(way), spread.range
        return out

    def describe(self) -> str:
        parts = [f"{'write over it' if way == 'overwrite' else way} {self.gbps(way):.2f} GB/s "
                 f"(rounds {self.spread(way).low:.2f} to {self.spread(way).high:.2f})" for way in WAYS]
        return (f"{', '.join(parts)}; {len(self.rounds)} rounds, each round's chunks at once, "
                f"{self.request_bytes / 2**20:.2f} MiB requests, {self.threads} thread(s)")


def chunks_of(length: int, block_size: int, chunk_tokens: int) -> int:
    """Chunk files a prompt of `length` tokens is saved in and loaded from: its whole blocks, the last one
    included, a chunk's worth at a time (the last file may hold fewer)."""
    blocks = length // block_size
    per_chunk = max(1, chunk_tokens // block_size)
    return -(-blocks // per_chunk)

"""The drive alone in the connector's own pattern, measured round by round beside the connector's rounds: the
reference the disk-speed suite holds the connector's delivered bandwidth to.

This VM's drive moves by a fifth within minutes (the connector's own load path alone read 1.28 GB/s, then
1.08 GB/s ten minutes later with the same code: docs/notes/2026-12-02-paired.md). A reference taken before or
after the rounds, however well it copies the pattern, then says as much about when it ran as about the
connector. So each of the connector's rounds (its cold request's saves, its engine hit's last block and its
tier hit's load) is followed at once by raw requests of the same size in the same pattern, none of the
store's code: the round's chunks handed to the connector's number of threads at once, written into a fresh
file, read back in the round's own loads (the chunk file of the last block beside the engine hit, then the
whole prompt's, the drive's rest before each), and written over again (probe.probe_disk_bursts): a read
after a rest is slower, and the connector's figure has them (docs/notes/2026-12-02-loads.md). Both figures are bytes over busy
time summed over the same rounds, so they cover the same minutes of the drive; the per-round figures give
the spread.

Each round is also paired on its own: the connector's counters over the round (CountersMoved) against the bursts
right after it, one ratio a round, whose median and spread say whether the summed figure's gap is the
connector's (every round short of the drive) or one slow minute of the drive's (one round far off).

The split after the rounds is paired the same way: passes of the drive alone and of the connector's code
alone in the pattern run in turn, and the code's share is the median of their paired ratios (paired_median).
pattern_lines prints both.

The writes are the round's save batches: one burst where a prompt's prefill is one step, as many equal ones
as the connector wrote batches where it took several (the 4,096-token prompts of the disk-speed suite
prefill in two steps on the CPU build): a drive serves a burst after a rest more slowly.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from pytest_kvoffload.drive.probe import BurstResult, probe_disk_bursts, write_reference
from pytest_kvoffload.drive.rate import Rate

WAYS = ("write", "overwrite", "read")

# Passes of the drive alone and of the connector's code alone in the pattern after the rounds, interleaved (a
# pair each; suite_machinery/disk_speed.py).
PATTERN_PASSES = 3


@dataclass(frozen=True)
class CountersMoved:
    """What the connector's counters (their kvoffload:*_total deltas) moved between two readings: one round, or
    the whole run (suite_machinery/disk_speed.py)."""
    read_bytes: float = 0.0
    read_s: float = 0.0  # load_wall_seconds: each instant with a load in flight once
    write_bytes: float = 0.0
    write_s: float = 0.0  # save_wall_seconds, likewise
    over_share: float = 0.0  # of the chunks written, those written over a recycled file
    save_batches: float = 0.0  # the steps whose saves were written: a prefill of several steps writes in as many

    @classmethod
    def between(cls, start: dict, end: dict) -> CountersMoved:
        d = {k: end.get(k, 0.0) - start.get(k, 0.0) for k in end}
        written = d.get("chunks_written", 0.0)
        over_share = d.get("chunks_written_over_free", 0.0) / written if written else 0.0
        return cls(d.get("bytes_read", 0.0), d.get("load_wall_seconds", 0.0), d.get("bytes_written", 0.0),
                   d.get("save_wall_seconds", 0.0), over_share, d.get("save_batches", 0.0))

    def gbps(self, way: str) -> float:
        moved, busy = (self.read_bytes, self.read_s) if way == "read" else (self.write_bytes, self.write_s)
        return moved / busy / 1e9 if busy > 0 and moved > 0 else 0.0


@dataclass
class DriveBeside:
    """Raw bursts after each connector round (after_round), summed as the connector's counters sum its I/O."""
    folder: Path
    request_bytes: int  # a chunk file's bytes
    threads: int  # the connector's io_threads
    rounds: list[BurstResult] = field(default_factory=list)
    connector: list[CountersMoved] = field(default_factory=list)  # the connector's own figures, round by round

    def after_round(self, chunks: int, idle_s: float, moved: CountersMoved | None = None,
                    loads: tuple[int, ...] = ()) -> BurstResult:
        """The round's `chunks` chunk files' worth of raw requests, written, read and written over, each way
        written in as many bursts as the connector wrote batches in the round (`moved`: a prefill of two
        steps saves in two), each after `idle_s` of nothing (the drive's rest before the connector's saves);
        the reads in `loads` (chunk files a load, in the round's order) where given, else one load of them
        all; `moved`, what the connector's counters moved in the round, also for the pairs (round_ratios)."""
        chunks = max(1, chunks)
        batches = max(1, round(moved.save_batches)) if moved else 1
        burst = -(-chunks // batches)  # whole bursts: where they do not divide the chunks, one more is written
        time.sleep(idle_s)
        result = probe_disk_bursts(self.folder, self.request_bytes, burst, idle_s,
                                   total_bytes=-(-chunks // burst) * burst * self.request_bytes, repeats=1,
                                   threads=self.threads, read_burst=chunks, read_loads=loads)
        self.rounds.append(result)
        self.connector.append(moved or CountersMoved())
        return result

    def round_ratios(self, way: str) -> list[float]:
        """The connector over the drive right after it, one ratio a round where both moved bytes (writes
        against the drive's figure for that round's mix of new and recycled files)."""
        ratios = []
        for drive, ours in zip(self.rounds, self.connector):
            reference = write_reference(drive, ours.over_share) if way == "write" else drive.read_gbps
            if reference and ours.gbps(way):
                ratios.append(ours.gbps(way) / reference)
        return ratios

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

    write_gbps = property(lambda self: self.gbps("write"))
    overwrite_gbps = property(lambda self: self.gbps("overwrite"))

    def write_reference(self, over_share: float) -> float:
        """The drive's write bandwidth for the connector's mix of new and recycled files (probe.write_reference
        over the summed figures)."""
        return write_reference(self, over_share)

    def to_dict(self) -> dict:
        out = {"rounds": len(self.rounds), "request_bytes": self.request_bytes, "threads": self.threads}
        for way in WAYS:
            spread = self.spread(way)
            out[f"{way}_gbps"], out[f"{way}_range"] = self.gbps(way), spread.range
        for way in ("write", "read"):
            each = self.round_ratios(way)
            paired = Rate.of(each)
            out[f"{way}_round_ratios"] = ({"median": paired.median, "low": paired.low, "high": paired.high,
                                          "rounds": len(each), "each": each} if paired else None)
        return out

    def describe_pairs(self) -> str:
        """The per-round pairs (to_dict's), or "" where no round has both figures."""
        shown = self.to_dict()
        return ", ".join(f"{way} {p['median']:.2f} ({p['low']:.2f} to {p['high']:.2f}, {p['rounds']} rounds)"
                         for way in ("write", "read") if (p := shown[f"{way}_round_ratios"]))

    def reads_said(self) -> str:
        """How the rounds' reads were replayed, for describe."""
        loads = [r.read_loads for r in self.rounds if len(r.read_loads) > 1]
        if not loads:
            return "at once"
        return f"in the round's own loads ({' then '.join(map(str, loads[0]))} chunks in the first such round)"

    def describe(self) -> str:
        parts = [f"{'write over it' if way == 'overwrite' else way} {self.gbps(way):.2f} GB/s "
                 f"(rounds {self.spread(way).low:.2f} to {self.spread(way).high:.2f})" for way in WAYS]
        return (f"{', '.join(parts)}; {len(self.rounds)} rounds, each round's chunks written in its save batches "
                f"and read {self.reads_said()}, {self.request_bytes / 2**20:.2f} MiB requests, "
                f"{self.threads} thread(s)")


def files_spanned(first_token: int, end_token: int, chunk_tokens: int) -> int:
    """Chunk files a load of tokens [first_token, end_token) reads: each file it touches, whole (store.read
    reads a file's blocks at once, the ones the engine has too)."""
    if end_token <= first_token:
        return 0
    return -(-end_token // chunk_tokens) - first_token // chunk_tokens


def round_loads(engine_hit: dict[str, int], tier_hit: dict[str, int], chunk_tokens: int) -> tuple[int, ...]:
    """The chunk files of a round's loads in turn, from where its hits' tokens came (cached_by_source): the
    files of the blocks read beside the engine hit (its last block), then the tier hit's."""
    beside = engine_hit.get("device", 0)
    return (files_spanned(beside, beside + engine_hit.get("disk", 0), chunk_tokens),
            files_spanned(0, tier_hit.get("disk", 0), chunk_tokens))


def chunks_of(length: int, block_size: int, chunk_tokens: int) -> int:
    """Chunk files a prompt of `length` tokens is saved in and loaded from: its whole blocks, the last one
    included, a chunk's worth at a time (the last file may hold fewer)."""
    blocks = length // block_size
    per_chunk = max(1, chunk_tokens // block_size)
    return -(-blocks // per_chunk)


def passes(results: list):
    """Single-pass burst results as one: each rate the median, lowest and highest of the passes."""
    return replace(results[0], **{way: Rate.of(r.rate(way).median for r in results if r.rate(way))
                                  for way in ("write", "overwrite", "read") if hasattr(results[0], way)})


def paired_median(drives: list[BurstResult], workers: list, way: str, over_share: float) -> float | None:
    """The median over interleaved passes of the connector's code alone over the drive alone in the pattern
    (writes against the drive's figure for the connector's mix of new and recycled files)."""
    ratios = []
    for drive, worker in zip(drives, workers):
        reference = write_reference(drive, over_share) if way == "write" else drive.read_gbps
        ours = worker.rate(way).median
        if reference and ours:
            ratios.append(ours / reference)
    return statistics.median(ratios) if ratios else None


def pattern_lines(figures: dict, beside: DriveBeside, code_share: dict, drive_bursts, worker_bursts, over_share: float,
                  reference: dict, delivered: dict, gap_s: float | None) -> str:
    """The targets' ratio against the drive in the connector's pattern beside the rounds, then the gap split
    in three: the pattern on the drive, the connector's code, the engine."""
    breakdown = ""
    if beside.rounds and delivered["read"]:
        # The targets' reference: the drive in the connector's own pattern right after each round (raw
        # requests, drive/round_reference.py), summed over the rounds as the connector's counters are.
        figures["drive_in_pattern_beside_rounds"] = beside.to_dict()
        ours = {"write": beside.write_reference(over_share), "read": beside.gbps("read")}
        ratios = []
        for way in ("write", "read"):
            if ours[way] and delivered[way]:
                figures[f"{way}_drive_in_pattern_gbps"] = ours[way]
                figures[f"{way}_vs_drive_in_pattern"] = delivered[way] / ours[way]
                # Three places: these are the figures held to targets, and at two a miss can print as a pass.
                ratios.append(f"{way.upper()} {figures[f'{way}_vs_drive_in_pattern']:.3f} "
                              f"({delivered[way] * 1e3:,.0f} against {ours[way] * 1e3:,.0f} MB/s)")
        breakdown += (f"\nthe drive alone in the connector's pattern right after each round (raw requests, no "
                      f"store code): {beside.describe()}\n"
                      f"connector / the drive in the connector's own pattern: {', '.join(ratios)}")
        pairs = beside.describe_pairs()
        if pairs:
            # Beside the summed ratio (the targets' figure), round by round: a median near it and a narrow
            # spread say the gap is the connector's; a wide one, with the summed figure far from the median,
            # that a few rounds of the drive's made it.
            breakdown += f"; round by round, the median of the paired ratios: {pairs}"
    if drive_bursts:
        # After the rounds, the same pattern with the rounds' gaps: against the continuous probe, what the
        # pattern itself costs here.
        pattern = {"write": write_reference(drive_bursts, over_share), "read": drive_bursts.read_gbps}
        costs = []
        for way in ("write", "read"):
            if not pattern[way]:
                continue
            figures[f"{way}_drive_in_bursts_gbps"] = pattern[way]
            figures[f"{way}_drive_in_bursts_vs_probe"] = pattern[way] / reference[way] if reference[way] else None
            costs.append(f"{way} {pattern[way]:.2f} GB/s = {figures[f'{way}_drive_in_bursts_vs_probe'] or 0:.2f}")
        figures["save_gap_s"] = gap_s
        breakdown += (f"\nafter the rounds, the drive alone in that pattern with the rounds' gaps (a step's saves "
                      f"came {gap_s * 1e3:.0f} ms apart): {drive_bursts.describe()}; for the connector's mix "
                      f"{', '.join(costs)} of the continuous probe (what the pattern costs on this drive)")
        if worker_bursts:
            # The rest split in two: the connector's code alone against the drive in the pattern (pass by pass),
            # and the connector in the server against its code alone (the engine beside it).
            code, engine = [], []
            for way in ("write", "read"):
                alone_gbps = getattr(worker_bursts, f"{way}_gbps")
                share = code_share.get(way)
                if not (alone_gbps and share):
                    continue
                figures[f"{way}_worker_alone_vs_drive_in_bursts"] = share
                figures[f"{way}_vs_worker_alone"] = delivered[way] / alone_gbps
                code.append(f"{way} {share:.2f}")
                engine.append(f"{way} {figures[f'{way}_vs_worker_alone']:.2f}")
            breakdown += (f"\nthe connector's save and load paths alone in that pattern, no engine, a pass of each "
                          f"in turn: {worker_bursts.describe()}: {', '.join(code)} of the drive in it (the median "
                          f"of {PATTERN_PASSES} paired passes: what the code costs); the connector in the server "
                          f"{', '.join(engine)} of them (what the engine beside it costs)")
    return breakdown

"""The kvoffload-disk tier against the raw drive, side by side in one run on the same drive (the disk-speed
suite's measurements; suites/test_disk_speed.py asserts and prints them).

Prints figures (no timed asserts): the connector's delivered read and write bandwidth as a share of
the drive's O_DIRECT probe at the connector's chunk size, bytes moved per useful KV byte, and disk-hit
TTFT against device-hit and cold TTFT at each length. Correctness is still asserted: every hit must
come from the source it is meant to come from.

The drive is probed before and after the connector's rounds (a virtual disk drifts: the ratio is taken
against their mean and their difference is printed), and the store alone (probe_store: chunk files
written and read by ChunkStore, no engine) is measured after them, so that the gap to the drive splits
into what the file format costs and what sharing the machine with the engine costs. Where the engine binds
its worker to some cores (vLLM's CPU build: the connector's I/O threads inherit that binding) the store
alone is measured on those cores too, and the CPU time the server's processes take during the rounds is
printed beside the figures (drive/cpu_use.py).

Writes are held to the drive's figure for the writes the connector made: the probe writes a fresh file
and then over it, and the connector's chunks written over recycled files (store.py) count against the
second (twice the first on the 2-core VM). The scheduler's per-chunk times of the connector's I/O threads
are printed beside those of the store alone.

The connector's own pattern is bursts: a step's chunks written at once, a load's chunks read at once (in a
round, the file of a prompt's last block beside its engine hit, then the whole prompt's), then nothing. The
drive alone in that pattern, measured right after each of the connector's rounds (raw requests, none of our
code: drive/round_reference.py), is the reference the targets are held to: both figures cover
the same minutes of a drive that moves by a fifth within minutes. After the rounds the gap splits in
three: what the pattern costs on the drive (drive in bursts / continuous probe), what the connector's code
costs (its save and load paths alone in the pattern, no engine: drive/worker_probe.py, pass by pass
interleaved with the drive alone in it, the median of the paired ratios) and what the engine beside it
costs (the connector in the server against its code alone).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from tabulate import tabulate

from pytest_kvoffload.connector.io_threads import MIN_SLICE_US
from pytest_kvoffload.connector.chunk_format import HEADER_SIZE
from pytest_kvoffload.connector.worker import LOAD_THREADS, SAVE_THREADS
from pytest_kvoffload.core.machine import has_cuda
from pytest_kvoffload.core.models import DTYPE_BYTES
from pytest_kvoffload.core.progress import Say, Tracker
from pytest_kvoffload.core.settings import Settings
from pytest_kvoffload.drive.round_reference import (PATTERN_PASSES, CountersMoved, DriveBeside, chunks_of, paired_median,
                                           passes, pattern_lines, round_loads)
from pytest_kvoffload.drive.cpu_use import describe, narrowest_affinity, sample, thread_times, usage
from pytest_kvoffload.drive.engine_load import EngineLoad
from pytest_kvoffload.drive.probe import probe_disk, probe_disk_bursts, probe_store, write_reference
from pytest_kvoffload.drive.worker_probe import probe_worker_bursts
from pytest_kvoffload.measure.prompts import expected_cached, make_prompt
from pytest_kvoffload.serve.client import Endpoint, measure
from pytest_kvoffload.serve.builtin.kvoffload_disk import NAME as OURS

TOTALS = ("bytes_read", "useful_bytes_read", "bytes_written", "useful_bytes_written", "load_wall_seconds",
          "save_wall_seconds", "load_seconds", "save_seconds", "save_copy_seconds", "save_wait_seconds", "save_first_wait_seconds", "save_batches", "chunks_read", "chunks_written",
          "io_threads_short_slice", "chunks_written_over_free")


# The longest idle gap between the bursts of the in-bursts controls (see there). On the 2-core VM 50, 100 and
# 250 ms gave the same figures (docs/notes/2026-12-01-bursts.md).
MAX_GAP_S = 0.1

# A round's counters are read once they stop moving for this long (they reach /metrics with the engine's
# steps, which the round's last request ended), within this bound; what arrives later counts in the next round.
ROUND_QUIET_S, ROUND_SETTLE_S = 0.2, 3.0

# What the store-alone-beside-the-engine pass checks did (not) move.
QUIET = ("chunks_read", "chunks_written", "requests_opted_out")


def totals(endpoint, names=TOTALS) -> dict:
    extra = endpoint.metrics().extra
    return {name: extra.get(f"kvoffload:{name}_total", 0.0) for name in names}


def settled_totals(endpoint, quiet_s: float = 1.0, deadline_s: float = 30.0, names=TOTALS) -> dict:
    """Totals once they stop moving: counters reach /metrics with the engine's next stats update."""
    end = time.monotonic() + deadline_s
    last = totals(endpoint, names)
    while time.monotonic() < end:
        time.sleep(quiet_s)
        now = totals(endpoint, names)
        if now == last:
            return now
        last = now
    return last


@dataclass
class DiskSpeed:
    """One run of the comparison: what it measured (`figures`, kept in run.json), the text printed, and the
    problems found (a hit from the wrong source, a control that moved), for the suite to assert on."""
    endpoint: Endpoint
    store: Path
    settings: Settings
    lengths: tuple[int, ...]
    chunk_tokens: int  # the connector's chunk files' tokens (its option chunk_tokens)
    salt: str
    progress: Say
    figures: dict = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    text: str = ""

    def run(self) -> DiskSpeed:
        s = self.settings
        self.chunk_file = HEADER_SIZE + self.chunk_tokens * s.kv_bytes_per_token
        self.store.mkdir(parents=True, exist_ok=True)
        # The connector's pattern: its chunk files, its I/O threads, fresh files (drive/probe.py).
        self.threads = int(s.disk_opts.get("io_threads", 2))
        self.probe_bytes = max(256 << 20, 64 * self.chunk_file)
        self.before = probe_disk(self.store, request_bytes=self.chunk_file, total_bytes=self.probe_bytes,
                                 threads=self.threads)
        self.pgid = getattr(self.endpoint, "pgid", None)
        self.worker_cpus = narrowest_affinity(self.pgid)
        self.slice_us = int(s.disk_opts.get("io_slice_us", MIN_SLICE_US))
        self.endpoint.reset_prefix_cache(external=True)
        self.rounds()
        self.store_alone()
        self.in_the_pattern()
        self.beside_the_engine()
        self.shares()
        self.per_chunk()
        self.render()
        return self

    def rounds(self) -> None:
        """Cold, device-hit and disk-hit TTFT at each length, with the counters and CPU use around them."""
        kv_server, kv_settings = self.endpoint, self.settings
        self.start = settled_totals(kv_server)
        self.cpu_start = sample(self.pgid)
        self.io_start = {name: thread_times(self.pgid, name) for name in (SAVE_THREADS, LOAD_THREADS)}
        self.rows, self.ttft = [], {}
        self.drive_beside = DriveBeside(self.store, self.chunk_file, self.threads)
        self.rounds_started = time.monotonic()
        last = self.start
        tracker = Tracker(self.progress, f"disk speed on {OURS}", len(self.lengths) * kv_settings.rounds,
                          "lengths x rounds", total_work=sum(self.lengths) * kv_settings.rounds)
        for length in self.lengths:
            times = {"cold": [], "device": [], "disk": []}
            for r in range(kv_settings.rounds):
                tokens = make_prompt(length, 1.0, salt=f"{self.salt}|disk-speed|{r}",
                                     vocab_size=kv_settings.model.vocab_size).tokens
                cold = measure(kv_server, tokens)
                device = measure(kv_server, tokens)
                kv_server.reset_prefix_cache(external=False)
                disk = measure(kv_server, tokens)
                kv_server.reset_prefix_cache(external=False)
                # The round's own counters (a fraction of a second: the drive rests through it anyway), then the
                # drive alone in the round's pattern (drive/round_reference.py): the targets' reference. Its reads are the
                # round's loads as the hits report them: the files beside the engine hit, then the tier hit's.
                now = settled_totals(kv_server, quiet_s=ROUND_QUIET_S, deadline_s=ROUND_SETTLE_S)
                self.drive_beside.after_round(chunks_of(length, kv_settings.block_size, self.chunk_tokens),
                                              cold.client_ttft_s, CountersMoved.between(last, now),
                                              round_loads(device.cached_by_source, disk.cached_by_source,
                                                          self.chunk_tokens))
                last = now
                # Every whole block, the last one too: beside an engine hit that one comes from disk.
                whole = expected_cached(length, length, kv_settings.block_size, last_block=True)
                engine = expected_cached(length, length, kv_settings.block_size)
                wants = ((cold, {}), (device, {"device": engine, "disk": whole - engine}), (disk, {"disk": whole}))
                for result, expected in wants:
                    got = {k: v for k, v in result.cached_by_source.items() if v}
                    expected = {k: v for k, v in expected.items() if v}
                    if got != expected:
                        self.problems.append(f"{length} tokens, round {r + 1}: cached {got}, expected {expected}")
                for name, result in (("cold", cold), ("device", device), ("disk", disk)):
                    times[name].append(result.client_ttft_s)
                tracker.step(f"{length} tokens, round {r + 1}", work=length)
            p50 = {name: statistics.median(v) for name, v in times.items()}
            self.ttft[length] = p50
            self.rows.append([length, f"{p50['cold'] * 1e3:,.0f}", f"{p50['device'] * 1e3:,.0f}",
                              f"{p50['disk'] * 1e3:,.0f}", f"{p50['disk'] / p50['device']:.2f}",
                              f"{p50['cold'] / p50['disk']:.2f}"])

    def store_alone(self) -> None:
        """The drive probed again, and the store alone (chunk files, no engine) as the connector wrote."""
        kv_server, store, threads, probe_bytes, chunk_file = (self.endpoint, self.store, self.threads,
                                                              self.probe_bytes, self.chunk_file)
        pgid = self.pgid
        self.cpu_end = sample(pgid)
        self.rounds_s = time.monotonic() - self.rounds_started
        self.io_end = {name: thread_times(pgid, name) for name in (SAVE_THREADS, LOAD_THREADS)}
        self.end = end = settled_totals(kv_server)
        self.after = probe_disk(store, request_bytes=chunk_file, total_bytes=probe_bytes, threads=threads)
        # The store alone from here on writes as the connector did in the rounds: this share of its chunks over
        # free files (store.py recycles removed chunks' files), the rest into new ones.
        self.written = end["chunks_written"] - self.start["chunks_written"]
        # The whole run's counters, read as each round's are (beside.CountersMoved).
        self.moved = CountersMoved.between(self.start, end)
        self.over_share = over_share = self.moved.over_share
        # After the rounds, whose reads the store's writes would otherwise cost what the host caches.
        self.alone = probe_store(store, chunk_file, total_bytes=probe_bytes, threads=threads, over_share=over_share)
        # As the connector's I/O threads run: on the worker's CPUs, with the connector's scheduler slice.
        self.alone_bound = (probe_store(store, chunk_file, total_bytes=probe_bytes, threads=threads, cpus=self.worker_cpus,
                                   slice_us=self.slice_us, over_share=over_share) if self.worker_cpus else None)

    def in_the_pattern(self) -> None:
        """The drive alone in the connector's bursts, then the connector's own paths in them (no engine)."""
        start, end, written, store, chunk_file, threads = (self.start, self.end, self.written, self.store,
                                                           self.chunk_file, self.threads)
        kv_settings, over_share, worker_cpus = self.settings, self.over_share, self.worker_cpus
        rounds_s, lengths = self.rounds_s, self.lengths
        # The connector's own pattern, no engine: a step's chunks written at once and a prompt's read at once,
        # then the drive idle until the next (as many chunks and as far apart as in the rounds, on average). First
        # the drive alone in it (raw requests, none of our code): against the continuous probe, what the pattern
        # itself costs on this drive (the targets' reference is the drive beside the rounds, drive/round_reference.py), and
        # the partner of the code-alone passes. Gaps are cut to MAX_GAP_S to
        # bound the suite's time: a shorter gap can only make the drive look better than the connector, never
        # worse (on the 2-core VM 50, 100 and 250 ms gaps gave the same, within noise).
        batches = end["save_batches"] - start["save_batches"]
        drive_bursts, worker_bursts, gap_s = None, None, None
        self.code_share = {}
        if batches and written:
            gap_s = max(0.0, (rounds_s - (end["save_wall_seconds"] - start["save_wall_seconds"])) / batches)
            burst = round(written / batches)
            # A load reads a prompt's chunks at once: one load per disk hit of the rounds, the engine hits' one-file
            # loads folded into them (the rounds' own loads are the reference beside them, drive/round_reference.py).
            read_burst = max(1, round((end["chunks_read"] - start["chunks_read"]) / (len(lengths) * kv_settings.rounds)))
            # Then the connector's own save and load paths in the same pattern (its options, its threads on the
            # worker's CPUs): against the drive in it, what its code costs; the rounds against it, the engine.
            # The CPU build's paths only: on CUDA the connector copies through pinned memory on its own streams,
            # which a CPU cache in this process would not run, so no figure rather than another path's.
            # Pass by pass, a pass of each in turn: the drive moves within minutes, so the code's share is the
            # median of the passes' paired ratios, not a ratio of figures taken minutes apart.
            drives, workers = [], []
            for _ in range(PATTERN_PASSES):
                drives.append(probe_disk_bursts(store, chunk_file, burst, min(gap_s, MAX_GAP_S), total_bytes=32 << 20,
                                                repeats=1, threads=threads, read_burst=read_burst))
                if not has_cuda():
                    workers.append(probe_worker_bursts(
                        store, {"chunk_tokens": self.chunk_tokens, **kv_settings.disk_opts},
                        kv_settings.model.num_layers, kv_settings.block_size, kv_settings.kv_bytes_per_token,
                        DTYPE_BYTES[kv_settings.dtype], burst, min(gap_s, MAX_GAP_S), repeats=1,
                        over_share=over_share, cpus=worker_cpus, read_burst=read_burst))
            drive_bursts = passes(drives)
            worker_bursts = passes(workers) if workers else None
            self.code_share = {way: paired_median(drives, workers, way, over_share) for way in ("write", "read")}
        self.drive_bursts, self.worker_bursts, self.gap_s = drive_bursts, worker_bursts, gap_s

    def beside_the_engine(self) -> None:
        kv_server, store, chunk_file, threads, over_share = (self.endpoint, self.store, self.chunk_file, self.threads,
                                                             self.over_share)
        probe_bytes, slice_us, kv_settings = self.probe_bytes, self.slice_us, self.settings
        # After the rounds (its writes would flush what the host still caches of their chunks): the store alone
        # again while the engine does the rounds' work (fresh prompts of the same lengths, one after another)
        # with the connector told to keep out (drive/engine_load.py): what the machine leaves a drive writer beside
        # vLLM, without the connector's code. Not bound to the worker's CPUs: there, a thread of another
        # process got no CPU at all beside a busy worker (Linux 6.18), while the worker's own threads, the
        # connector's, kept pace (docs/notes/2026-11-30-late.md).
        quiet = settled_totals(kv_server, names=QUIET)
        with EngineLoad(kv_server, self.lengths, kv_settings.model.vocab_size) as load:
            beside = probe_store(store, chunk_file, total_bytes=probe_bytes, threads=threads, slice_us=slice_us,
                                 over_share=over_share)
        if load.errors or not load.requests:
            self.problems.append(f"the engine load failed: {load.errors[:1]}")
        moved = {k: v - quiet[k] for k, v in settled_totals(kv_server, names=QUIET).items() if v != quiet[k]}
        # The control: requests_opted_out must have moved (the requests reached the connector and kept out),
        # the chunk counters must not (no I/O of the connector's in the figure).
        if not (moved.pop("requests_opted_out", 0) > 0 and not moved):
            self.problems.append(f"the connector moved chunks beside the store: {moved}")
        # Capped: the store got (almost) no CPU while the engine computed; the figure is then not "beside".
        beside_ok = not load.capped
        self.load, self.beside, self.beside_ok = load, beside, beside_ok

    def shares(self) -> None:
        """Delivered bandwidth against the drive's probes, the store alone and the store beside the engine."""
        start, end, before, after, alone, alone_bound = (self.start, self.end, self.before, self.after, self.alone,
                                                         self.alone_bound)
        beside, beside_ok, load, over_share = self.beside, self.beside_ok, self.load, self.over_share
        drive_bursts, worker_bursts, worker_cpus = self.drive_bursts, self.worker_bursts, self.worker_cpus
        cpu_start, cpu_end, ttft = self.cpu_start, self.cpu_end, self.ttft
        d = {k: end[k] - start[k] for k in TOTALS}

        delivered = {way: self.moved.gbps(way) for way in ("read", "write")}
        figures = {
            "probe": before.to_dict(), "probe_after": after.to_dict(), "store_alone": alone.to_dict(),
            "store_alone_on_worker_cpus": alone_bound.to_dict() if alone_bound else None,
            "store_alone_beside_engine": beside.to_dict() if beside_ok else None,
            "drive_in_bursts": drive_bursts.to_dict() if drive_bursts else None,
            "worker_alone_in_bursts": worker_bursts.to_dict() if worker_bursts else None,
            "engine_load_requests": load.requests,
            "worker_cpus": sorted(worker_cpus) if worker_cpus else None,
            "cpu_use_during_rounds": usage(cpu_start, cpu_end) if cpu_start and cpu_end else None,
            "ttft_p50_s": {str(k): v for k, v in ttft.items()}, "counters": d,
            "read_amplification": d["bytes_read"] / d["useful_bytes_read"] if d["useful_bytes_read"] else None,
            "write_amplification": d["bytes_written"] / d["useful_bytes_written"] if d["useful_bytes_written"] else None,
        }
        # Writes are held to the drive's figure for what they did: a chunk written over a recycled file
        # (store.py) against the probe's write over its file, one into a new file against its fresh write.
        figures["write_over_free_share"] = over_share
        reference = {"read": (before.read_gbps + after.read_gbps) / 2,
                     "write": (write_reference(before, over_share) + write_reference(after, over_share)) / 2}
        figures["write_reference_gbps"] = reference["write"]
        summary_rows = []
        for way in ("read", "write"):
            drive = reference[way]
            store_gbps = getattr(alone, f"{way}_gbps")
            figures[f"delivered_{way}_gbps"] = delivered[way]
            figures[f"{way}_vs_probe"] = delivered[way] / drive if drive else None
            figures[f"{way}_store_vs_probe"] = store_gbps / drive if drive else None
            figures[f"{way}_vs_store"] = delivered[way] / store_gbps if store_gbps else None
            bound_gbps = getattr(alone_bound, f"{way}_gbps") if alone_bound else store_gbps
            beside_gbps = getattr(beside, f"{way}_gbps") if beside_ok else None
            figures[f"{way}_vs_store_beside_engine"] = delivered[way] / beside_gbps if beside_gbps else None
            figures[f"{way}_probe_drift"] = (getattr(after, f"{way}_gbps") / getattr(before, f"{way}_gbps") - 1
                                             if getattr(before, f"{way}_gbps") else None)
            summary_rows.append([
                way, f"{delivered[way]:.2f}", f"{store_gbps:.2f}",
                (f"{before.read_gbps:.2f} / {after.read_gbps:.2f}" if way == "read" else
                 f"{write_reference(before, over_share):.2f} / {write_reference(after, over_share):.2f}"),
                f"{figures[f'{way}_vs_probe'] or 0:.2f}", f"{figures[f'{way}_store_vs_probe'] or 0:.2f}",
                f"{figures[f'{way}_vs_store'] or 0:.2f}",
                f"{bound_gbps:.2f} / {beside_gbps:.2f}" if beside_gbps else f"{bound_gbps:.2f} / starved",
                f"{figures[f'{way}_vs_store_beside_engine'] or 0:.2f}",
                f"{figures[f'{way}_amplification'] or 0:.3f}"])
        summary = tabulate(summary_rows, headers=["", "connector GB/s", "store alone GB/s", "probe before / after",
                                                  "connector/probe", "store/probe", "connector/store",
                                                  "store on worker CPUs / beside engine GB/s",
                                                  "connector/store beside engine", "bytes per useful byte"], disable_numparse=True)
        self.d, self.figures, self.delivered, self.reference, self.summary = d, figures, delivered, reference, summary

    def per_chunk(self) -> None:
        d, threads, alone, figures = self.d, self.threads, self.alone, self.figures
        io_start, io_end, over_share, reference = self.io_start, self.io_end, self.over_share, self.reference
        alone_bound, beside, beside_ok = self.alone_bound, self.beside, self.beside_ok
        # Where a save's time goes, per chunk and I/O thread: the gather from the KV cache and the file write in
        # the engine, against the same write by the store alone (threads x a chunk over its bandwidth).
        per_chunk = {
            "save_first_wait_ms": 1e3 * d["save_first_wait_seconds"] / d["save_batches"] if d["save_batches"] else None,
            "save_wait_ms": 1e3 * d["save_wait_seconds"] / d["chunks_written"] if d["chunks_written"] else None,
            "save_copy_ms": 1e3 * d["save_copy_seconds"] / d["chunks_written"] if d["chunks_written"] else None,
            "save_write_ms": 1e3 * d["save_seconds"] / d["chunks_written"] if d["chunks_written"] else None,
            "store_alone_write_ms": 1e3 * threads * alone.request_bytes / (alone.write_gbps * 1e9) if alone.write_gbps else None,
            "load_read_ms": 1e3 * d["load_seconds"] / d["chunks_read"] if d["chunks_read"] else None,
            "store_alone_read_ms": 1e3 * threads * alone.request_bytes / (alone.read_gbps * 1e9) if alone.read_gbps else None,
        }
        # What the scheduler gave the I/O threads during the rounds, per chunk: time on a CPU, and time runnable
        # but waiting for one (the core was the forward's or the engine core's). Of a save's time beyond the
        # store alone's, the waiting is the machine's share; the rest is the connector's code.
        for name, way, count in ((SAVE_THREADS, "save", d["chunks_written"]), (LOAD_THREADS, "load", d["chunks_read"])):
            first, last = io_start[name], io_end[name]
            if last and count:
                spent = last.since(first) if first else last  # pools start threads on demand: none yet is zero
                per_chunk[f"{way}_on_cpu_ms"] = 1e3 * spent.on_cpu_s / count
                per_chunk[f"{way}_waiting_for_cpu_ms"] = 1e3 * spent.waiting_s / count
        figures["per_chunk"] = per_chunk
        shown = {k: f"{v:.2f}" if v is not None else "-" for k, v in per_chunk.items()}
        breakdown = (f"chunks written over a removed chunk's file (the rest into new files): {over_share:.0%}; the "
                     f"write reference for that mix {reference['write']:.2f} GB/s\n"
                     f"per chunk and I/O thread, ms: waited {shown['save_wait_ms']} for a thread (a step's first "
                     f"chunk {shown['save_first_wait_ms']}); save = gather {shown['save_copy_ms']} + write {shown['save_write_ms']} "
                     f"(the store alone writes one in {shown['store_alone_write_ms']}); load = read and check "
                     f"{shown['load_read_ms']} (alone {shown['store_alone_read_ms']})")
        if "save_waiting_for_cpu_ms" in per_chunk:
            def sched(probe) -> str:
                if probe is None or probe.write_on_cpu_ms is None:
                    return "-"
                return f"{probe.write_on_cpu_ms:.2f} and {probe.write_waiting_for_cpu_ms:.2f}"
            breakdown += (f"\nscheduler, ms per chunk written (on a CPU and runnable but waiting for one): the connector's "
                          f"save threads {shown['save_on_cpu_ms']} and {shown['save_waiting_for_cpu_ms']}; the store "
                          f"alone {sched(alone_bound or alone)}, beside the engine {sched(beside if beside_ok else None)}; "
                          f"load threads {shown.get('load_on_cpu_ms', '-')} and {shown.get('load_waiting_for_cpu_ms', '-')} "
                          f"per chunk read")
        self.breakdown = breakdown

    def render(self) -> None:
        rows, figures, worker_cpus, end, breakdown = self.rows, self.figures, self.worker_cpus, self.end, self.breakdown
        drive_bursts, worker_bursts, over_share, reference = (self.drive_bursts, self.worker_bursts, self.over_share,
                                                              self.reference)
        delivered, gap_s = self.delivered, self.gap_s
        table = tabulate(rows, headers=["length", "cold ms", "device-hit ms", "disk-hit ms", "disk/device", "cold/disk"],
                         disable_numparse=True)
        cpu = figures["cpu_use_during_rounds"]
        placement = (f"the worker is bound to CPUs {sorted(worker_cpus)} (its I/O threads with it); "
                     if worker_cpus else "")
        # A total, not a difference: I/O threads start with the server's first loads and saves.
        machine = (f"during the rounds {placement}{describe(cpu)}; I/O threads with a short slice (io_slice_us): "
                   f"{end['io_threads_short_slice']:.0f}\n" if cpu else "")
        self.text = self.text_of(machine, breakdown + pattern_lines(
            figures, self.drive_beside, self.code_share, drive_bursts, worker_bursts, over_share, reference, delivered,
            gap_s), table)

    def text_of(self, machine: str, breakdown: str, table: str) -> str:
        store, before, after, alone, summary, kv_settings = (self.store, self.before, self.after, self.alone,
                                                             self.summary, self.settings)
        return (f"drive under {store}: probe before {before.describe()}; after {after.describe()}\n"
                f"(shares are of the mean of the two probes; store alone: {alone.describe()})\n{summary}\n{breakdown}\n"
                f"{machine}\n"
                f"TTFT p50 over {kv_settings.rounds} rounds, fully cached prompts\n{table}")

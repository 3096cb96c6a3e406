"""The disk tier against the raw drive, side by side in one run on the same drive.

Prints figures (no timed asserts): the connector's delivered read and write bandwidth as a share of
the drive's O_DIRECT probe at the connector's chunk size, bytes moved per useful KV byte, and disk-hit
TTFT against device-hit and cold TTFT at each length. Correctness is still asserted: every hit must
come from the source it is meant to come from.

The drive is probed before and after the connector's rounds (a virtual disk drifts: the ratio is taken
against their mean and their difference is printed), and the store alone (probe_store: chunk files
written and read by ChunkStore, no engine) is measured between them, so that the gap to the drive splits
into what the file format costs and what sharing two cores with the engine costs.
"""

import time

import pytest
from tabulate import tabulate

from pytest_kvoffload.backends import kvoffload_store_dir
from pytest_kvoffload.client import measure
from pytest_kvoffload.connector.store import HEADER_SIZE
from pytest_kvoffload.probe import probe_disk, probe_store
from pytest_kvoffload.progress import Tracker
from pytest_kvoffload.prompts import expected_cached, make_prompt
from pytest_kvoffload.stats import summarize

pytestmark = pytest.mark.parametrize("kv_backend", ["kvoffload-disk"], indirect=True, scope="session")

TOTALS = ("bytes_read", "useful_bytes_read", "bytes_written", "useful_bytes_written", "load_wall_seconds",
          "save_wall_seconds", "load_seconds", "save_seconds", "save_copy_seconds", "save_wait_seconds", "save_first_wait_seconds", "save_batches", "chunks_read", "chunks_written")


def totals(endpoint) -> dict:
    extra = endpoint.metrics().extra
    return {name: extra.get(f"kvoffload:{name}_total", 0.0) for name in TOTALS}


def settled_totals(endpoint, quiet_s: float = 1.0, deadline_s: float = 30.0) -> dict:
    """Totals once they stop moving: counters reach /metrics with the engine's next stats update."""
    end = time.monotonic() + deadline_s
    last = totals(endpoint)
    while time.monotonic() < end:
        time.sleep(quiet_s)
        now = totals(endpoint)
        if now == last:
            return now
        last = now
    return last


def test_disk_tier_against_the_raw_drive(kv_session, kv_backend, kv_server, kv_settings):
    if kv_backend.name not in kv_settings.backends:
        pytest.skip(f"{kv_backend.name} is not among --kv-backend")
    granularity = kv_backend.granularity(kv_settings)
    chunk_file = HEADER_SIZE + granularity * kv_settings.kv_bytes_per_token
    store = kvoffload_store_dir(kv_session.context(kv_backend))
    store.mkdir(parents=True, exist_ok=True)
    # The connector's pattern: its chunk files, its I/O threads, fresh files (probe.py).
    threads = int(kv_settings.disk_opts.get("io_threads", 2))
    probe_bytes = max(256 << 20, 64 * chunk_file)
    before = probe_disk(store, request_bytes=chunk_file, total_bytes=probe_bytes, threads=threads)
    alone = probe_store(store, chunk_file, total_bytes=probe_bytes, threads=threads)

    kv_server.reset_prefix_cache(external=True)
    start = settled_totals(kv_server)
    rows, ttft = [], {}
    tracker = Tracker(kv_session.progress, f"disk speed on {kv_backend.name}",
                      len(kv_session.lengths) * kv_settings.rounds, "lengths x rounds",
                      total_work=sum(kv_session.lengths) * kv_settings.rounds)
    for length in kv_session.lengths:
        times = {"cold": [], "device": [], "disk": []}
        for r in range(kv_settings.rounds):
            tokens = make_prompt(length, 1.0, salt=f"{kv_session.salt}|disk-speed|{r}",
                                 vocab_size=kv_settings.model.vocab_size).tokens
            cold = measure(kv_server, tokens)
            device = measure(kv_server, tokens)
            kv_server.reset_prefix_cache(external=False)
            disk = measure(kv_server, tokens)
            kv_server.reset_prefix_cache(external=False)
            want = expected_cached(length, length, kv_settings.block_size, granularity)
            assert sum(cold.cached_by_source.values()) == 0, cold.cached_by_source
            assert device.cached_by_source == {"device": expected_cached(length, length, kv_settings.block_size)}
            assert disk.cached_by_source == {"disk": want}, disk.cached_by_source
            for name, result in (("cold", cold), ("device", device), ("disk", disk)):
                times[name].append(result.client_ttft_s)
            tracker.step(f"{length} tokens, round {r + 1}", work=length)
        p50 = {name: summarize(v)["p50"] for name, v in times.items()}
        ttft[length] = p50
        rows.append([length, f"{p50['cold'] * 1e3:,.0f}", f"{p50['device'] * 1e3:,.0f}", f"{p50['disk'] * 1e3:,.0f}",
                     f"{p50['disk'] / p50['device']:.2f}", f"{p50['cold'] / p50['disk']:.2f}"])
    end = settled_totals(kv_server)
    after = probe_disk(store, request_bytes=chunk_file, total_bytes=probe_bytes, threads=threads)
    d = {k: end[k] - start[k] for k in TOTALS}

    delivered = {"read": d["bytes_read"] / d["load_wall_seconds"] / 1e9 if d["load_wall_seconds"] else 0.0,
                 "write": d["bytes_written"] / d["save_wall_seconds"] / 1e9 if d["save_wall_seconds"] else 0.0}
    figures = {
        "probe": before.to_dict(), "probe_after": after.to_dict(), "store_alone": alone.to_dict(),
        "ttft_p50_s": {str(k): v for k, v in ttft.items()}, "counters": d,
        "read_amplification": d["bytes_read"] / d["useful_bytes_read"] if d["useful_bytes_read"] else None,
        "write_amplification": d["bytes_written"] / d["useful_bytes_written"] if d["useful_bytes_written"] else None,
    }
    summary_rows = []
    for way in ("read", "write"):
        drive = (getattr(before, f"{way}_gbps") + getattr(after, f"{way}_gbps")) / 2
        store_gbps = getattr(alone, f"{way}_gbps")
        figures[f"delivered_{way}_gbps"] = delivered[way]
        figures[f"{way}_vs_probe"] = delivered[way] / drive if drive else None
        figures[f"{way}_store_vs_probe"] = store_gbps / drive if drive else None
        figures[f"{way}_vs_store"] = delivered[way] / store_gbps if store_gbps else None
        figures[f"{way}_probe_drift"] = (getattr(after, f"{way}_gbps") / getattr(before, f"{way}_gbps") - 1
                                         if getattr(before, f"{way}_gbps") else None)
        summary_rows.append([
            way, f"{delivered[way]:.2f}", f"{store_gbps:.2f}",
            f"{getattr(before, f'{way}_gbps'):.2f} / {getattr(after, f'{way}_gbps'):.2f}",
            f"{figures[f'{way}_vs_probe'] or 0:.2f}", f"{figures[f'{way}_store_vs_probe'] or 0:.2f}",
            f"{figures[f'{way}_vs_store'] or 0:.2f}", f"{figures[f'{way}_amplification'] or 0:.3f}"])
    summary = tabulate(summary_rows, headers=["", "connector GB/s", "store alone GB/s", "probe before / after",
                                              "connector/probe", "store/probe", "connector/store",
                                              "bytes per useful byte"], disable_numparse=True)
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
    figures["per_chunk"] = per_chunk
    shown = {k: f"{v:.2f}" if v is not None else "-" for k, v in per_chunk.items()}
    breakdown = (f"per chunk and I/O thread, ms: waited {shown['save_wait_ms']} for a thread (a step's first "
                 f"chunk {shown['save_first_wait_ms']}); save = gather {shown['save_copy_ms']} + write {shown['save_write_ms']} "
                 f"(the store alone writes one in {shown['store_alone_write_ms']}); load = read and check "
                 f"{shown['load_read_ms']} (alone {shown['store_alone_read_ms']})")
    table = tabulate(rows, headers=["length", "cold ms", "device-hit ms", "disk-hit ms", "disk/device", "cold/disk"],
                     disable_numparse=True)
    text = (f"drive under {store}: probe before {before.describe()}; after {after.describe()}\n"
            f"(shares are of the mean of the two probes; store alone: {alone.describe()})\n{summary}\n{breakdown}\n\n"
            f"TTFT p50 over {kv_settings.rounds} rounds, fully cached prompts\n{table}")
    kv_session.add_benchmark("kvoffload-disk speed", text, figures)
    assert d["useful_bytes_read"] > 0 and d["useful_bytes_written"] > 0

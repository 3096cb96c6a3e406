"""The drive probe and the connector's store alone, idle and beside a load that stands in for the engine.

    .venv/bin/python scripts/store_under_load.py FOLDER [--rounds 5] [--load torch|python] [--switch-ms MS]
                                                 [--cpus 0]

`torch` keeps both cores busy in matrix products (they release the GIL), as the CPU build's forward holds
the cores; `python` holds the GIL in a pure-Python loop, as the engine's Python does between kernels.
`--cpus` binds the load and the store's threads to those CPUs (the probe stays free), as vLLM's CPU build
binds its worker, and the connector's I/O threads with it, to the forward's cores.
Rounds interleave idle and loaded passes; medians printed. It separates what the machine and the
interpreter cost the connector's I/O threads from what its own code costs (docs/connector.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pytest_kvoffload.drive.probe import probe_disk, probe_store  # noqa: E402


def burner(kind: str, stop: threading.Event, cpus: set[int] | None) -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)  # before torch starts its threads here: they inherit it
    if kind == "python":
        x = 0
        while not stop.is_set():
            for i in range(1000):
                x += i
        return
    import torch

    torch.set_num_threads(len(cpus) if cpus else 2)
    a = torch.randn(768, 768)
    while not stop.is_set():
        a @ a


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--load", choices=("torch", "python"), default="torch")
    parser.add_argument("--switch-ms", type=float, default=None, help="sys.setswitchinterval, ms (Python: 5)")
    parser.add_argument("--mib", type=int, default=128, help="bytes per pass, MiB")
    parser.add_argument("--cpus", default=None, help="CPUs to bind the load and the store to, e.g. 0 or 0,1")
    args = parser.parse_args(argv)
    cpus = None
    if args.cpus is not None:
        allowed = os.sched_getaffinity(0)
        try:
            cpus = {int(c) for c in args.cpus.split(",")}
        except ValueError:
            cpus = set()
        if not cpus or not cpus <= allowed:
            print(f"store_under_load: --cpus {args.cpus}: expected CPU numbers from {sorted(allowed)}, "
                  "comma-separated", file=sys.stderr)
            return 2
    if not Path(args.folder).is_dir():
        print(f"store_under_load: {args.folder} is not a folder", file=sys.stderr)
        return 2
    if args.switch_ms is not None:
        sys.setswitchinterval(args.switch_ms / 1e3)
    results: dict[str, list[tuple[float, float]]] = {}
    for _ in range(args.rounds):
        for loaded in (False, True):
            stop = threading.Event()
            thread = threading.Thread(target=burner, args=(args.load, stop, cpus)) if loaded else None
            if thread:
                thread.start()
                time.sleep(0.3)
            try:
                probe = probe_disk(args.folder, 1 << 20, args.mib << 20, repeats=1, threads=2)
                store = probe_store(args.folder, 1 << 20, args.mib << 20, repeats=1, threads=2, cpus=cpus)
            finally:
                if thread:
                    stop.set()
                    thread.join()
            tag = f"beside {args.load}" if loaded else "idle"
            results.setdefault(f"probe {tag}", []).append((probe.write_gbps, probe.read_gbps))
            results.setdefault(f"store {tag}", []).append((store.write_gbps, store.read_gbps))
    for name, values in results.items():
        print(f"{name:20s} write {statistics.median(w for w, _ in values):.2f} GB/s, "
              f"read {statistics.median(r for _, r in values):.2f} GB/s (medians of {len(values)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

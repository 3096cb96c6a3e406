"""A prepared check for a lent GPU: the connector's CUDA path and the host/device bandwidth it rides on.

The lent machine has PyTorch but no vLLM, so this drives the connector's worker half directly (the two
vLLM base classes its metadata derives from are stubbed when vLLM is absent) on KV caches laid out as
vLLM 0.33 lays them (vllm/v1/worker/utils.py allocate_kv_cache): one int8 allocation, and per layer a
[num_blocks, num_kv_heads, block_size, 2 x head_size] bf16 view into it, layer-outermost (each layer a
contiguous region) or block-outermost (each block all layers' pages, so a layer's blocks are strided).

1. Byte-exact round trips: random blocks saved to chunk files (pinned buffers, per-thread side
   streams, O_DIRECT), the cache blocks overwritten, loaded back into other block ids, compared bit for
   bit; whole chunks and a prefix ending inside a chunk, in both layouts.
2. Connector throughput: save and load GB/s of whole chunks, next to the raw drive (probe_disk) and to
   pinned/pageable host<->device copies of the same size.

Sized for the lent machine (64 GiB of disk, 15 minutes of device time, so a rerun fits): --help states the
bytes written and read, the most on disk at once and the time budget; runs not started by the budget
are reported as skipped, not run late.

Usage: python scripts/gpu_check.py --out $OUT/gpu_check.json [--device cuda|cpu] [--store DIR] [--quick]
Writes the figures as JSON and prints a table. With --device cpu it runs the same checks on the CPU
path (the test suite does this, so the script cannot rot between GPU sessions).
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
import types
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def stub_vllm_if_missing() -> bool:
    """Give metadata.py its two base classes when vLLM is not installed; True if stubbed."""
    try:
        import vllm.distributed.kv_transfer.kv_connector.v1.base  # noqa: F401
        return False
    except Exception:
        pass
    names = ["vllm", "vllm.distributed", "vllm.distributed.kv_transfer", "vllm.distributed.kv_transfer.kv_connector",
             "vllm.distributed.kv_transfer.kv_connector.v1", "vllm.distributed.kv_transfer.kv_connector.v1.base"]
    for name in names:
        if sys.modules.get(name) is None:
            sys.modules[name] = types.ModuleType(name)
    base = sys.modules[names[-1]]
    base.KVConnectorMetadata = type("KVConnectorMetadata", (), {})
    base.KVConnectorWorkerMetadata = type("KVConnectorWorkerMetadata", (), {})
    return True


@dataclass(frozen=True)
class Geometry:
    name: str
    layers: int
    kv_heads: int
    head_size: int
    block_size: int
    chunk_tokens: int

    def kv_bytes_per_token(self, itemsize: int = 2) -> int:
        return self.layers * 2 * self.kv_heads * self.head_size * itemsize


LLAMA_3_2_3B = Geometry("llama-3.2-3b", layers=28, kv_heads=8, head_size=128, block_size=16, chunk_tokens=256)
TINY = Geometry("tiny", layers=4, kv_heads=2, head_size=64, block_size=16, chunk_tokens=64)

LAYOUTS = ("layer-outermost", "block-outermost")


@dataclass(frozen=True)
class Plan:
    """What one invocation does: round trips of (layout, chunks, I/O threads), then the drive probe of
    `probe_chunks` chunk-sized requests (probe_disk: 3 passes of write, read, write-over, a fresh file each)."""

    geometry: Geometry
    runs: tuple[tuple[str, int, int], ...]
    probe_chunks: int
    budget_s: float = 240.0

    def chunk_bytes(self) -> int:
        return self.geometry.chunk_tokens * self.geometry.kv_bytes_per_token()

    def bytes_written(self) -> int:
        return self.chunk_bytes() * (sum(c for _, c, _ in self.runs) + 3 * 2 * self.probe_chunks)

    def bytes_read(self) -> int:
        # Each round trip reads its chunks whole, then one chunk's first half again.
        return self.chunk_bytes() * (sum(c for _, c, _ in self.runs) + len(self.runs) + 3 * self.probe_chunks)

    def most_on_disk(self) -> int:
        return self.chunk_bytes() * max(max(c for _, c, _ in self.runs), self.probe_chunks)

    def cache_bytes(self) -> int:
        per_chunk = self.geometry.chunk_tokens // self.geometry.block_size
        blocks = 2 * max(c for _, c, _ in self.runs) * per_chunk + 8
        return blocks * self.chunk_bytes() // per_chunk

    def describe(self) -> str:
        gb = 1e9
        return (f"{self.geometry.name}: {len(self.runs)} round trips ({', '.join(f'{c} chunks {layout}' for layout, c, _ in self.runs)}) "
                f"of {self.chunk_bytes() / 2**20:.1f} MiB chunks, then the drive probe of {self.probe_chunks} chunks x 3 passes; "
                f"writes {self.bytes_written() / gb:.1f} GB, reads {self.bytes_read() / gb:.1f} GB, at most "
                f"{self.most_on_disk() / gb:.1f} GB on disk at once, a KV cache of {self.cache_bytes() / gb:.1f} GB; "
                f"runs not started within {self.budget_s:.0f} s are skipped (--budget-s)")


FULL = Plan(LLAMA_3_2_3B, (("layer-outermost", 4, 1), ("layer-outermost", 32, 4), ("block-outermost", 32, 4)),
            probe_chunks=64)
QUICK = Plan(TINY, (("layer-outermost", 2, 1), ("block-outermost", 2, 1)), probe_chunks=16)


def kv_cache_views(geometry: Geometry, num_blocks: int, device: str, layout: str) -> dict:
    """vLLM 0.33's cache: one int8 allocation, a bf16 [B, H, N, C] view per layer at
    offset + l * layer_stride + b * block_stride (bytes)."""
    import torch

    page = geometry.kv_heads * geometry.block_size * 2 * geometry.head_size * 2  # one layer's block, bytes
    raw = torch.zeros(page * num_blocks * geometry.layers, dtype=torch.int8, device=device)
    if layout == "layer-outermost":
        layer_stride, block_stride = page * num_blocks, page
    else:
        layer_stride, block_stride = page, page * geometry.layers
    inner = (geometry.kv_heads, geometry.block_size, 2 * geometry.head_size)
    inner_strides = (geometry.block_size * 2 * geometry.head_size, 2 * geometry.head_size, 1)
    views = {}
    for i in range(geometry.layers):
        # In bf16 elements (2 bytes): the int8 buffer viewed as bf16, then strided per layer.
        as_bf16 = raw.view(torch.bfloat16)
        views[f"model.layers.{i}.self_attn.attn"] = torch.as_strided(
            as_bf16, (num_blocks, *inner), (block_stride // 2, *inner_strides), (i * layer_stride) // 2)
    return views


def make_worker(store: Path, geometry: Geometry, num_blocks: int, device: str, io_threads: int,
                layout: str = "layer-outermost"):
    from pytest_kvoffload.connector.config import ConnectorConfig
    from pytest_kvoffload.connector.worker import WorkerSide

    config = ConnectorConfig.from_extra({"store_dir": str(store), "chunk_tokens": geometry.chunk_tokens,
                                         "io_threads": io_threads}, geometry.block_size)
    worker = WorkerSide(config, f"gpu-check|{geometry.name}", store / "rank0", geometry.block_size)
    caches = kv_cache_views(geometry, num_blocks, device, layout)
    worker.register_kv_caches(caches)
    return worker, list(caches.values())


def settle(worker, finished: set[str], timeout: float = 120.0) -> tuple[set[str], set[str]]:
    sent, received = set(), set()
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        s, r = worker.get_finished(finished)
        sent |= s or set()
        received |= r or set()
        if not worker._saves and not worker._loads:
            return sent, received
        time.sleep(0.001)
    raise TimeoutError("the connector's I/O did not finish")


def save_chunks(worker, layers, chunks: list[list[int]], tag: str) -> float:
    """Save each list of block ids as one chunk file; returns the wall seconds until all are on disk."""
    from pytest_kvoffload.connector.metadata import KVOffloadMetadata, SaveJob

    _sync(layers)
    started = time.perf_counter()
    jobs = [SaveJob(f"{tag}-{i}", chunk_key(i), ids, i) for i, ids in enumerate(chunks)]
    worker.wait_for_save(KVOffloadMetadata(saves=jobs))
    sent, _ = settle(worker, {j.req_id for j in jobs})
    missing = [j.key for j in jobs if not worker.store.path(j.key).is_file()]
    if sent != {j.req_id for j in jobs} or missing:
        raise RuntimeError(f"saves did not complete: {missing or sent}")
    return time.perf_counter() - started


def chunk_key(i: int) -> str:
    return f"{0xC0FFEE:08x}{i:024x}"  # the store's keys are 32 hex digits


def load_chunks(worker, layers, loads: list[tuple[str, list[tuple[int, int]]]]) -> float:
    """Load (key, [(block in chunk, destination block id)]) as one async request; wall seconds."""
    from pytest_kvoffload.connector.metadata import ChunkBlocks, KVOffloadMetadata, LoadJob

    started = time.perf_counter()
    job = LoadJob("load", [ChunkBlocks(key, blocks) for key, blocks in loads])
    worker.start_load_kv(KVOffloadMetadata(loads=[job]))
    _, received = settle(worker, set())
    if "load" not in received or worker.block_ids_with_load_errors():
        raise RuntimeError("a chunk failed to load")
    _sync(layers)
    return time.perf_counter() - started


def _sync(layers) -> None:
    import torch

    if layers[0].is_cuda:
        torch.cuda.synchronize(layers[0].device)


def round_trip(store: Path, geometry: Geometry, device: str, chunks: int, io_threads: int,
               layout: str = "layer-outermost") -> dict:
    """Random blocks -> chunk files -> other block ids; every bit compared (as int16: random bf16 bits
    include NaNs, which equal nothing)."""
    import torch

    per_chunk = geometry.chunk_tokens // geometry.block_size
    num_blocks = 2 * chunks * per_chunk + 8
    base = chunks * per_chunk
    worker, layers = make_worker(store, geometry, num_blocks, device, io_threads, layout)
    generator = torch.Generator(device="cpu").manual_seed(0)
    for layer in layers:
        layer[:base].view(torch.int16).copy_(
            torch.randint(-2**15, 2**15, layer[:base].shape, generator=generator, dtype=torch.int16))
    sources = [list(range(c * per_chunk, (c + 1) * per_chunk)) for c in range(chunks)]
    save_s = save_chunks(worker, layers, sources, "k")
    keys = [chunk_key(i) for i in range(chunks)]
    expected = [layer[:base].view(torch.int16).clone() for layer in layers]
    # Whole chunks into fresh block ids ...
    loads = [(keys[c], [(i, base + c * per_chunk + i) for i in range(per_chunk)]) for c in range(chunks)]
    load_s = load_chunks(worker, layers, loads)
    exact = all(torch.equal(layer[base:2 * base].view(torch.int16), ref) for layer, ref in zip(layers, expected))
    # ... and a prefix that ends inside a chunk: only its first blocks, the rest untouched.
    partial = max(1, per_chunk // 2)
    for layer in layers:
        layer[base:].zero_()
    load_chunks(worker, layers, [(keys[0], [(i, base + i) for i in range(partial)])])
    exact_partial = all(torch.equal(layer[base:base + partial].view(torch.int16), ref[:partial])
                        and not layer[base + partial:base + per_chunk].view(torch.int16).any()
                        for layer, ref in zip(layers, expected))
    nbytes = chunks * per_chunk * layers[0][0].numel() * layers[0].element_size() * len(layers)
    worker.shutdown()
    return {"geometry": geometry.name, "layout": layout, "chunks": chunks, "bytes": nbytes, "byte_exact": exact,
            "byte_exact_partial_chunk": exact_partial, "save_gbps": nbytes / save_s / 1e9,
            "load_gbps": nbytes / load_s / 1e9, "direct_io": worker.store.direct_io, "io_threads": io_threads,
            "one_copy_for_all_layers": getattr(worker, "stacked", None) is not None}


def copy_bandwidth(nbytes: int, device: str, repeats: int = 5) -> dict:
    """Host<->device GB/s for one copy of nbytes: pinned and pageable host memory."""
    import torch

    if device != "cuda":
        return {}
    gpu = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = {}
    for kind, host in (("pinned", torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)),
                       ("pageable", torch.empty(nbytes, dtype=torch.uint8))):
        for direction in ("h2d", "d2h"):
            times = []
            for _ in range(repeats):
                torch.cuda.synchronize()
                started = time.perf_counter()
                if direction == "h2d":
                    gpu.copy_(host, non_blocking=kind == "pinned")
                else:
                    host.copy_(gpu, non_blocking=kind == "pinned")
                torch.cuda.synchronize()
                times.append(time.perf_counter() - started)
            out[f"{kind}_{direction}_gbps"] = nbytes / statistics.median(times) / 1e9
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog=f"Full run: {FULL.describe()}. --quick: {QUICK.describe()}. Measured with --device cpu on the "
               "2-core VM: the full run in 26 s (docs/backends.md, GPU check).")
    parser.add_argument("--out", required=True, help="where to write the figures (JSON)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when available")
    parser.add_argument("--store", default=None,
                        help="folder on the machine's drive (default: a temporary one under $TMPDIR)")
    parser.add_argument("--quick", action="store_true", help="small geometry and sizes (the test suite's run)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="seconds after which no further run starts (default 240: a rerun fits in 15 minutes)")
    args = parser.parse_args(argv)

    stubbed = stub_vllm_if_missing()
    import torch

    from pytest_kvoffload.drive.probe import probe_disk

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: --device cuda, but torch sees no CUDA device", file=sys.stderr)
        return 2
    if args.store and not Path(args.store).is_dir():
        print(f"gpu_check: --store {args.store} is not a folder", file=sys.stderr)
        return 2
    plan = QUICK if args.quick else FULL
    if args.budget_s is not None:
        plan = Plan(plan.geometry, plan.runs, plan.probe_chunks, args.budget_s)
    started = time.monotonic()
    geometry = plan.geometry
    figures: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "device": device, "host": platform.node(),
        "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None, "torch": torch.__version__,
        "vllm_stubbed": stubbed, "geometry": geometry.__dict__, "plan": plan.describe(),
        "kv_bytes_per_token": geometry.kv_bytes_per_token(), "skipped": [],
    }
    with tempfile.TemporaryDirectory(dir=args.store) as tmp:
        root = Path(tmp)
        figures["round_trips"] = []
        for i, (layout, chunks, threads) in enumerate(plan.runs):
            if time.monotonic() - started > plan.budget_s:
                figures["skipped"].append(f"round trip {chunks} chunks {layout}: past the {plan.budget_s:.0f} s budget")
                continue
            figures["round_trips"].append(round_trip(root / f"rt{i}", geometry, device, chunks, threads, layout))
            shutil.rmtree(root / f"rt{i}", ignore_errors=True)  # the disk holds one run's chunks at a time
        chunk_bytes = plan.chunk_bytes()
        figures["chunk_bytes"] = chunk_bytes
        figures["copy"] = {str(n): copy_bandwidth(n, device) for n in (chunk_bytes, 64 * chunk_bytes)}
        if time.monotonic() - started > plan.budget_s:
            figures["skipped"].append(f"drive probe: past the {plan.budget_s:.0f} s budget")
            figures["drive"] = None
        else:
            probe = probe_disk(root, request_bytes=chunk_bytes, total_bytes=plan.probe_chunks * chunk_bytes)
            figures["drive"] = probe.to_dict()
    figures["seconds"] = round(time.monotonic() - started, 1)
    ok = bool(figures["round_trips"]) and all(r["byte_exact"] and r["byte_exact_partial_chunk"]
                                              for r in figures["round_trips"])
    figures["ok"] = ok
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(figures, indent=2))
    print(f"gpu_check on {figures['gpu'] or device}: byte-exact {'yes' if ok else 'NO'}, {figures['seconds']} s")
    for r in figures["round_trips"]:
        print(f"  {r['chunks']:>4} chunks x {chunk_bytes / 2**20:.1f} MiB, {r['layout']}, {r['io_threads']} threads: "
              f"save {r['save_gbps']:.2f} GB/s, load {r['load_gbps']:.2f} GB/s (O_DIRECT {r['direct_io']})")
    d = figures["drive"]
    if d:
        print(f"  drive: write {d['write_gbps']:.2f} GB/s, read {d['read_gbps']:.2f} GB/s (O_DIRECT {d['direct_io']})")
    for size, copies in figures["copy"].items():
        if copies:
            print(f"  {int(size) / 2**20:.0f} MiB copies: " + ", ".join(f"{k} {v:.1f}" for k, v in copies.items()))
    for line in figures["skipped"]:
        print(f"  skipped: {line}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

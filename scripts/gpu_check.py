"""A prepared check for a lent GPU: the connector's CUDA path and the host/device bandwidth it rides on.

The lent machine has PyTorch but no vLLM, so this drives the connector's worker half directly (the two
vLLM base classes its metadata derives from are stubbed when vLLM is absent) on KV caches shaped like
vLLM 0.33's: one tensor per layer, [num_blocks, num_kv_heads, block_size, 2 x head_size], bf16.

1. Byte-exact round trips: random blocks saved to chunk files (pinned buffers, per-thread side
   streams, O_DIRECT), the cache blocks overwritten, loaded back into other block ids, compared with
   torch.equal; whole chunks and a prefix ending inside a chunk.
2. Connector throughput: save and load GB/s of whole chunks, next to the raw drive (probe_disk) and to
   pinned/pageable host<->device copies of the same size.

Usage: python scripts/gpu_check.py --out $OUT/gpu_check.json [--device cuda|cpu] [--quick]
Writes the figures as JSON and prints a table. With --device cpu it runs the same checks on the CPU
path (the test suite does this, so the script cannot rot between GPU sessions).
"""

from __future__ import annotations

import argparse
import json
import platform
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


def make_worker(store: Path, geometry: Geometry, num_blocks: int, device: str, io_threads: int):
    import torch

    from pytest_kvoffload.connector.config import ConnectorConfig
    from pytest_kvoffload.connector.worker import WorkerSide

    config = ConnectorConfig.from_extra({"store_dir": str(store), "chunk_tokens": geometry.chunk_tokens,
                                         "io_threads": io_threads}, geometry.block_size)
    worker = WorkerSide(config, f"gpu-check|{geometry.name}", store / "rank0", geometry.block_size)
    shape = (num_blocks, geometry.kv_heads, geometry.block_size, 2 * geometry.head_size)
    caches = {f"model.layers.{i}.self_attn.attn": torch.zeros(shape, dtype=torch.bfloat16, device=device)
              for i in range(geometry.layers)}
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


def round_trip(store: Path, geometry: Geometry, device: str, chunks: int, io_threads: int) -> dict:
    """Random blocks -> chunk files -> other block ids; every byte compared."""
    import torch

    per_chunk = geometry.chunk_tokens // geometry.block_size
    num_blocks = 2 * chunks * per_chunk + 8
    worker, layers = make_worker(store, geometry, num_blocks, device, io_threads)
    generator = torch.Generator(device="cpu").manual_seed(0)
    for layer in layers:
        layer.copy_(torch.randn(layer.shape, generator=generator).to(torch.bfloat16))
    sources = [list(range(c * per_chunk, (c + 1) * per_chunk)) for c in range(chunks)]
    save_s = save_chunks(worker, layers, sources, "k")
    keys = [chunk_key(i) for i in range(chunks)]
    expected = [layer.clone() for layer in layers]
    base = chunks * per_chunk
    for layer in layers:
        layer[base:].zero_()
    # Whole chunks into fresh block ids ...
    loads = [(keys[c], [(i, base + c * per_chunk + i) for i in range(per_chunk)]) for c in range(chunks)]
    load_s = load_chunks(worker, layers, loads)
    exact = all(torch.equal(layer[base:base + chunks * per_chunk], ref[:chunks * per_chunk])
                for layer, ref in zip(layers, expected))
    # ... and a prefix that ends inside a chunk: only its first blocks, the rest untouched.
    partial = max(1, per_chunk // 2)
    for layer in layers:
        layer[base:].zero_()
    load_chunks(worker, layers, [(keys[0], [(i, base + i) for i in range(partial)])])
    exact_partial = all(torch.equal(layer[base:base + partial], ref[:partial])
                        and not layer[base + partial:base + per_chunk].any() for layer, ref in zip(layers, expected))
    nbytes = chunks * per_chunk * layers[0][0].numel() * layers[0].element_size() * len(layers)
    worker.shutdown()
    return {"geometry": geometry.name, "chunks": chunks, "bytes": nbytes, "byte_exact": exact,
            "byte_exact_partial_chunk": exact_partial, "save_gbps": nbytes / save_s / 1e9,
            "load_gbps": nbytes / load_s / 1e9, "direct_io": worker.store.direct_io, "io_threads": io_threads}


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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where to write the figures (JSON)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when available")
    parser.add_argument("--store", default=None, help="folder on the drive to use (default: a temporary one)")
    parser.add_argument("--quick", action="store_true", help="small geometry and sizes (the test suite's run)")
    args = parser.parse_args(argv)

    stubbed = stub_vllm_if_missing()
    import torch

    from pytest_kvoffload.drive.probe import probe_disk

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: --device cuda, but torch sees no CUDA device", file=sys.stderr)
        return 2
    geometry = TINY if args.quick else LLAMA_3_2_3B
    figures: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "device": device, "host": platform.node(),
        "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None, "torch": torch.__version__,
        "vllm_stubbed": stubbed, "geometry": geometry.__dict__,
        "kv_bytes_per_token": geometry.kv_bytes_per_token(),
    }
    with tempfile.TemporaryDirectory(dir=args.store) as tmp:
        root = Path(tmp)
        runs = [(2, 1)] if args.quick else [(4, 1), (32, 4), (128, 8)]
        figures["round_trips"] = [round_trip(root / f"rt{i}", geometry, device, chunks, threads)
                                  for i, (chunks, threads) in enumerate(runs)]
        chunk_bytes = geometry.chunk_tokens * geometry.kv_bytes_per_token()
        figures["chunk_bytes"] = chunk_bytes
        figures["copy"] = {str(n): copy_bandwidth(n, device) for n in (chunk_bytes, 64 * chunk_bytes)}
        probe = probe_disk(root, request_bytes=chunk_bytes, total_bytes=(16 if args.quick else 1024) * chunk_bytes)
        figures["drive"] = probe.to_dict()
    ok = all(r["byte_exact"] and r["byte_exact_partial_chunk"] for r in figures["round_trips"])
    figures["ok"] = ok
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(figures, indent=2))
    print(f"gpu_check on {figures['gpu'] or device}: byte-exact {'yes' if ok else 'NO'}")
    for r in figures["round_trips"]:
        print(f"  {r['chunks']:>4} chunks x {chunk_bytes / 2**20:.1f} MiB, {r['io_threads']} threads: "
              f"save {r['save_gbps']:.2f} GB/s, load {r['load_gbps']:.2f} GB/s (O_DIRECT {r['direct_io']})")
    d = figures["drive"]
    print(f"  drive: write {d['write_gbps']:.2f} GB/s, read {d['read_gbps']:.2f} GB/s (O_DIRECT {d['direct_io']})")
    for size, copies in figures["copy"].items():
        if copies:
            print(f"  {int(size) / 2**20:.0f} MiB copies: " + ", ".join(f"{k} {v:.1f}" for k, v in copies.items()))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

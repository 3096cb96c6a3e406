"""The CPU build's in-step gathers (worker.py): a step's chunks are copied from the cache and sealed (header
and checksum) before wait_for_save returns, up to a bound on the memory held, and the rest by their I/O
threads."""

import threading
import time

import torch

from test_index import finish, worker  # the worker over a small CPU cache, and waiting for its saves

from pytest_kvoffload.connector import worker as worker_module
from pytest_kvoffload.connector.metadata import ChunkBlocks, KVOffloadMetadata, LoadJob, SaveJob
from pytest_kvoffload.connector.buffers import GatheredBuffers
from pytest_kvoffload.connector.blocks import block_runs
BLOCKS = 12


def loaded_back(side, key, blocks):
    """Load chunk `key` into `blocks` and return those blocks of every layer. The load must pass the store's
    checks: the scatter runs before the checksum, so a chunk sealed wrong still lands its bytes."""
    side.start_load_kv(KVOffloadMetadata(loads=[LoadJob("r", [ChunkBlocks(key, list(enumerate(blocks)))], sync=True)]))
    assert not side.block_ids_with_load_errors(), f"chunk {key} failed the store's checks"
    return [layer[blocks].clone() for layer in side.layers]


def test_chunks_up_to_the_bound_are_copied_and_sealed_in_the_step_and_the_rest_by_their_threads(tmp_path,
                                                                                                monkeypatch):
    monkeypatch.setattr(worker_module, "GATHER_AHEAD_BYTES", 0)  # the bound: one chunk per I/O thread
    side = worker(tmp_path, BLOCKS)
    sealed_by, seal = {}, side.store.seal
    monkeypatch.setattr(side.store, "seal", lambda key, *args: (
        sealed_by.__setitem__(key, threading.current_thread().name), seal(key, *args))[1])
    assert side.step_buffers.limit == 2
    before = [layer.clone() for layer in side.layers]
    # Hold both save threads so that nothing is written until the cache has changed under the saves.
    gate = threading.Event()
    held = [side.save_pool.submit(gate.wait) for _ in range(2)]
    time.sleep(0.1)
    keys = [f"{i:032x}" for i in range(4)]
    saves = [SaveJob("p", key, [2 * i, 2 * i + 1], i, 0) for i, key in enumerate(keys)]
    side.wait_for_save(KVOffloadMetadata(saves=saves))
    for layer in side.layers:  # the next step overwrites the cache (in vLLM the blocks are held; here not)
        layer.fill_(7.0)
    gate.set()
    [f.result() for f in held]
    finish(side, "p")
    # The first two chunks were copied before wait_for_save returned: the step's KV. The last two were
    # copied by their threads after the change: the control, which tells the two paths apart.
    for i, key in enumerate(keys):
        blocks = [2 * i, 2 * i + 1]
        got = loaded_back(side, key, [8, 9])
        want = [layer[blocks] for layer in before] if i < 2 else [torch.full_like(before[0][blocks], 7.0)] * 2
        assert all(torch.equal(g, w) for g, w in zip(got, want)), f"chunk {i}"
    # Each sealed once, on the thread that gathered it (the loads above found every checksum right).
    assert [sealed_by[key] == threading.current_thread().name for key in keys] == [True, True, False, False]
    assert all(sealed_by[key].startswith(worker_module.SAVE_THREADS) for key in keys[2:]), sealed_by
    assert side.step_buffers.out == 0  # every buffer came back
    side.shutdown()


def test_buffers_are_bounded_and_reused():
    made = []
    pool = GatheredBuffers(lambda: made.append(object()) or made[-1], 2)
    a, b = pool.take(), pool.take()
    assert pool.take() is None  # past the bound: the I/O thread gathers
    pool.give_back(a)
    assert pool.take() is a and len(made) == 2
    pool.give_back(a)
    pool.give_back(b)
    assert len(made) == 2


def test_block_runs_split_where_either_side_jumps():
    assert block_runs([0, 1, 2, 3], [5, 6, 7, 8]) == [(0, 5, 4)]
    assert block_runs([0, 1, 2, 3], [5, 6, 9, 10]) == [(0, 5, 2), (2, 9, 2)]
    assert block_runs([1, 3], [4, 5]) == [(1, 4, 1), (3, 5, 1)]
    assert block_runs([2, 3], [7, 6]) == [(2, 7, 1), (3, 6, 1)]
    assert block_runs([], []) == []


def test_blocks_round_trip_through_scattered_block_ids(tmp_path):
    """Saved from block ids that jump and run backwards, loaded into others, part of a chunk too: every
    block lands where its id says (the slice copies of block_runs against an element-wise reference)."""
    side = worker(tmp_path, BLOCKS)
    torch.manual_seed(0)
    for layer in side.layers:
        layer.copy_(torch.randn_like(layer.float()).to(layer.dtype))
    before = [layer.clone() for layer in side.layers]
    key = f"{1:032x}"
    saved = [9, 3]  # a chunk of two blocks, its ids out of order
    side.wait_for_save(KVOffloadMetadata(saves=[SaveJob("p", key, saved, 0, 0)]))
    finish(side, "p")
    for target in ([0, 1], [11, 4]):
        got = loaded_back(side, key, target)
        assert all(torch.equal(g, layer[saved]) for g, layer in zip(got, before)), target
    # The second block of the chunk alone, into block 6: the load's index starts inside the chunk.
    side.start_load_kv(KVOffloadMetadata(loads=[LoadJob("q", [ChunkBlocks(key, [(1, 6)])], sync=True)]))
    assert all(torch.equal(layer[6], b[3]) for layer, b in zip(side.layers, before))
    side.shutdown()


def one_allocation(layers, blocks, shape, interleaved=False):
    """Per-layer views of one buffer, as vLLM's allocate_kv_cache makes them: layer after layer, or (interleaved)
    each block holding every layer's."""
    per = 1
    for n in shape:
        per *= n
    buffer = torch.randn(layers * blocks * per)
    if interleaved:
        return [buffer.as_strided((blocks, *shape), (layers * per, *torch.empty(shape).stride()), i * per)
                for i in range(layers)]
    return [buffer[i * blocks * per:(i + 1) * blocks * per].view(blocks, *shape) for i in range(layers)]


def test_layers_of_one_allocation_move_in_one_copy_and_round_trip(tmp_path):
    from pytest_kvoffload.connector.blocks import stacked_layers

    for interleaved in (False, True):
        layers = one_allocation(3, 6, (2, 4, 5), interleaved)
        stacked = stacked_layers(layers)
        assert stacked is not None and all(torch.equal(stacked[i], t) for i, t in enumerate(layers))
        stacked[1, 2].fill_(9.0)  # the same memory, not a copy
        assert torch.equal(layers[1][2], torch.full((2, 4, 5), 9.0))
    # Separate allocations, or a gap that differs between layers: no single view (each layer is copied alone).
    assert stacked_layers([torch.zeros(6, 2, 4, 5) for _ in range(3)]) is None
    buffer = torch.zeros(4 * 6 * 40)
    uneven = [buffer[o:o + 240].view(6, 2, 4, 5) for o in (0, 240, 720)]
    assert stacked_layers(uneven) is None

    # A worker over such a cache: a save and a load through the one-copy path give back every layer's blocks.
    side = worker(tmp_path, BLOCKS)
    side.layers[:] = one_allocation(2, BLOCKS, tuple(side.layers[0].shape[1:]))
    side.stacked = stacked_layers(side.layers)
    assert side.stacked is not None
    separate = worker(tmp_path / "separate", BLOCKS)  # the helper's layers are allocations of their own
    assert separate.stacked is None and separate.counters.drain()["blocks_one_copy"] == 0.0
    separate.shutdown()
    before = [layer.clone() for layer in side.layers]
    side.wait_for_save(KVOffloadMetadata(saves=[SaveJob("p", f"{5:032x}", [3, 7], 0, 0)]))
    finish(side, "p")
    got = loaded_back(side, f"{5:032x}", [10, 11])
    assert all(torch.equal(g, b[[3, 7]]) for g, b in zip(got, before))
    side.shutdown()


def test_a_chunk_damaged_past_its_header_is_scattered_then_reported_failed(tmp_path):
    """The scatter runs before the checksum (store.read's use): a payload that fails it leaves its blocks
    reported for recompute, none kept as loaded."""
    side = worker(tmp_path, BLOCKS)
    key = f"{2:032x}"
    side.wait_for_save(KVOffloadMetadata(saves=[SaveJob("p", key, [5, 6], 0, 0)]))
    finish(side, "p")
    path = side.store.path(key)
    data = bytearray(path.read_bytes())
    data[-4096 - 1] ^= 0xFF  # in the payload's last block, past every header check
    path.write_bytes(bytes(data))
    side.start_load_kv(KVOffloadMetadata(loads=[LoadJob("q", [ChunkBlocks(key, [(0, 1), (1, 2)])], sync=True)]))
    assert side.block_ids_with_load_errors() == {1, 2}
    assert side.counters.drain()["chunks_corrupt"] == 1
    side.shutdown()

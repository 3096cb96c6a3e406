"""The chunk index (one owner of what is stored), the scheduler half driving it, and the worker carrying out
its decisions, with vLLM-shaped stand-ins and real files."""

import os
import time
from types import SimpleNamespace

import pytest
import torch

from pytest_kvoffload.connector.config import ConnectorConfig
from pytest_kvoffload.connector.counters import Counters
from pytest_kvoffload.connector.hashing import block_keys
from pytest_kvoffload.connector.index import ChunkIndex
from pytest_kvoffload.connector.metadata import KVOffloadMetadata, KVOffloadWorkerMeta, SaveJob
from pytest_kvoffload.connector.scheduler import SchedulerSide
from pytest_kvoffload.connector.io_memory import ALIGN
from pytest_kvoffload.connector.chunk_format import Layout
from pytest_kvoffload.connector.store import ChunkStore

SIZE = 1000  # bytes of one chunk file in the index-only tests
BLOCK, CHUNK = 16, 32  # tokens
ROOT = b"root"


def blocks_of(tokens):
    return block_keys(tokens, BLOCK, ROOT)


def files_of(tokens):
    """The chunk files a prompt of whole chunks is saved in: each keyed by its last block."""
    per_chunk = CHUNK // BLOCK
    return blocks_of(tokens)[per_chunk - 1::per_chunk]


def keys(n, first=0):
    return [f"{i:032x}" for i in range(first, first + n)]


def stored(index, names):
    for key in names:
        assert index.prepare_store(key)
        index.complete_store(key, SIZE, index.generation)


def test_lookup_counts_leading_complete_chunks_only(tmp_path):
    index = ChunkIndex(tmp_path, 10 * SIZE, SIZE)
    a, b, c = keys(3)
    stored(index, [a, c])
    assert index.prepare_store(b)          # announced, not yet written
    assert index.lookup([a, b, c]) == 1    # a chunk being written is not a hit
    index.complete_store(b, SIZE, index.generation)
    assert index.lookup([a, b, c]) == 3
    assert not index.prepare_store(b)      # stored already: not written twice


def test_lru_eviction_keeps_recently_loaded_chunks(tmp_path):
    counters = Counters()
    index = ChunkIndex(tmp_path, 2 * SIZE, SIZE, counters)
    a, b, c = keys(3)
    stored(index, [a, b])
    index.prepare_load("r", [a])  # a is used: b is now the oldest
    index.complete_load("r")
    stored(index, [c])
    assert [k in index for k in (a, b, c)] == [True, False, True]
    assert index.take_deletions() == (False, [b])
    assert counters.drain()["chunks_evicted"] == 1


FILE_LAYOUT = Layout(layers=1, blocks=2, block_bytes=ALIGN)  # 12 KiB files of two blocks


def write_files(root, files):
    """Chunk files as the store writes them: {file key: its block keys}, the first oldest."""
    store = ChunkStore(root, "model=test", FILE_LAYOUT)
    for i, (key, blocks) in enumerate(files.items()):
        assert store.write(key, store.new_buffer(), block_keys=blocks)
        os.utime(store.path(key), (time.time() - 100 + i, time.time() - 100 + i))


def test_a_restarted_index_holds_the_files_on_disk_in_their_age_order(tmp_path):
    a, b, c, d = keys(4)
    write_files(tmp_path, {b: [a, b], c: [c]})  # a whole chunk, then a short last chunk of one block
    (tmp_path / ".tmp-partial").write_bytes(b"x")
    index = ChunkIndex(tmp_path, FILE_LAYOUT.file_bytes + FILE_LAYOUT.file_bytes_for(1), None)
    assert index.lookup([a, b, c]) == 3 and index.chunk_bytes == FILE_LAYOUT.file_bytes
    assert index.locate([a, b, c]) == [(b, 2, [(0, 0), (1, 1)]), (c, 1, [(0, 2)])]
    assert index.locate([d]) == [(d, 1, [(0, 0)])]  # not stored: a file the worker will find missing
    stored(index, [d])
    assert index.take_deletions() == (False, [b])


def test_an_old_format_store_is_counted_not_read_and_left_in_place(tmp_path, caplog):
    a, b = keys(2)
    write_files(tmp_path, {b: [a, b]})
    old = tmp_path / f"{a}.kv"
    data = bytearray((tmp_path / f"{b}.kv").read_bytes())
    data[8:12] = (2).to_bytes(4, "little")  # format version 2: whole chunks under one chunk key
    old.write_bytes(bytes(data))
    counters = Counters()
    with caplog.at_level("WARNING", logger="pytest_kvoffload.connector"):
        index = ChunkIndex(tmp_path, 1 << 20, None, counters)
    assert len(index) == 1 and index.lookup([a, b]) == 2 and a not in index
    assert counters.drain()["chunks_old_format"] == 1 and old.exists()
    assert "1 chunk files of an older format" in caplog.text and str(tmp_path) in caplog.text


def test_a_newer_file_holding_every_block_of_an_older_one_replaces_it(tmp_path):
    counters = Counters()
    index = ChunkIndex(tmp_path, 10 * SIZE, SIZE, counters)
    a, b, b2 = keys(3)
    assert index.prepare_store(a, [a])           # a prompt's short last chunk: one block
    index.complete_store(a, SIZE // 2, index.generation)
    assert not index.prepare_store(a, [a])       # nothing new in it
    assert index.prepare_store(b, [a, b])        # a longer prompt's whole chunk: the same block and one more
    index.complete_store(b, SIZE, index.generation)
    assert index.locate([a, b]) == [(b, 2, [(0, 0), (1, 1)])]
    assert index.take_deletions() == (False, [a]) and a not in index and index.used_bytes == SIZE
    assert counters.drain()["chunks_superseded"] == 1
    # A file being read when it is superseded goes once its load is done, not before.
    assert index.prepare_store(b2, [a, b2])
    index.prepare_load("r", [b])
    index.complete_store(b2, SIZE, index.generation)
    assert index.take_deletions() == (False, []) and index.lookup([a, b]) == 2
    index.complete_load("r")
    assert b in index and index.locate([a]) == [(b2, 2, [(0, 0)])]
    index.prepare_store(keys(1, 9)[0])
    assert b in index  # b still serves its own second block: kept


def test_a_chunk_larger_than_the_capacity_is_declined(tmp_path):
    counters = Counters()
    index = ChunkIndex(tmp_path, SIZE // 2, SIZE, counters)
    assert not index.prepare_store(keys(1)[0])
    assert counters.drain()["writes_declined"] == 1


def scheduler(tmp_path, capacity_chunks, load_mode="async"):
    config = ConnectorConfig.from_extra({"store_dir": str(tmp_path), "chunk_tokens": CHUNK, "load_mode": load_mode},
                                        BLOCK)
    counters = Counters()
    index = ChunkIndex(tmp_path / "rank0", capacity_chunks * SIZE, SIZE, counters)
    return SchedulerSide(config, BLOCK, ROOT, index, counters=counters), index, counters


def request(req_id, tokens):
    return SimpleNamespace(request_id=req_id, prompt_token_ids=list(tokens))


def new_step(req_id, tokens, block_ids):
    """A SchedulerOutput that computes a whole new prompt in one step."""
    new = SimpleNamespace(req_id=req_id, prompt_token_ids=list(tokens), num_computed_tokens=0, block_ids=(block_ids,))
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[])
    return SimpleNamespace(scheduled_new_reqs=[new], scheduled_cached_reqs=cached,
                           num_scheduled_tokens={req_id: len(tokens)})


def worker_reports(side, meta, failed=()):
    """The worker wrote every announced chunk (but `failed`) and reports it after the step."""
    report = KVOffloadWorkerMeta(
        stored=[(s.key, SIZE, s.generation) for s in meta.saves if s.key not in failed],
        store_failed=[(s.key, SIZE, s.generation) for s in meta.saves if s.key in failed])
    side.update_connector_output(SimpleNamespace(finished_sending=set(), finished_recving=set(),
                                                 kv_connector_worker_meta=report))


def prompt(seed, n=4 * CHUNK + 1):
    return [seed * 100_000 + i for i in range(n)]


def compute(side, req_id, tokens, block_ids):
    """A new request looked up (a miss) and computed in one step: the step's metadata."""
    assert side.get_num_new_matched_tokens(request(req_id, tokens), 0) == (0, False)
    return side.build_connector_meta(new_step(req_id, tokens, block_ids))


def prime(side, req_id, tokens):
    """Run a request through: computed, its chunks saved and reported."""
    meta = compute(side, req_id, tokens, list(range(len(tokens) // BLOCK + 1)))
    worker_reports(side, meta)
    side.request_finished(request(req_id, tokens), [])
    return meta


@pytest.mark.parametrize("pinning", [True, False], ids=["index", "planted-no-pin"])
def test_eviction_under_pressure_never_takes_a_chunk_being_loaded(tmp_path, monkeypatch, pinning):
    side, index, _ = scheduler(tmp_path, capacity_chunks=4)
    first = prompt(1)
    prime(side, "prime", first)
    promised = files_of(first)
    matched, is_async = side.get_num_new_matched_tokens(request("hit", first), 0)
    assert (matched, is_async) == (4 * CHUNK, True)
    if not pinning:
        # The planted fault: a load that does not protect its chunks, as the store did before the index.
        monkeypatch.setattr(index, "prepare_load", lambda req_id, names: None)
    side.update_state_after_alloc(request("hit", first), SimpleNamespace(get_block_ids=lambda: (list(range(20)),)),
                                  matched)
    meta = compute(side, "other", prompt(2), list(range(20, 40)))
    assert [c.key for c in meta.loads[0].chunks] == promised
    evicted_while_loading = set(promised) & set(meta.deletes)
    if not pinning:
        assert evicted_while_loading  # the check below fires on the planted fault
        return
    assert not evicted_while_loading and not meta.saves  # every stored chunk is being read: no room
    # Once the load is reported done, its chunks may go.
    side.update_connector_output(SimpleNamespace(finished_sending=set(), finished_recving={"hit"},
                                                 kv_connector_worker_meta=None))
    assert index.prepare_store(files_of(prompt(3))[0])


@pytest.mark.parametrize("waiting", [True, False], ids=["index", "planted-no-wait"])
def test_two_requests_sharing_a_prefix_read_each_chunk_once(tmp_path, monkeypatch, waiting):
    side, index, counters = scheduler(tmp_path, capacity_chunks=16)
    shared = prompt(1)
    prime(side, "prime", shared)
    one, two = shared[:3 * CHUNK] + prompt(2, CHUNK + 1), shared[:3 * CHUNK] + prompt(3, CHUNK + 1)
    if not waiting:
        monkeypatch.setattr(index, "loading_elsewhere", lambda names, req_id: False)
    matched, _ = side.get_num_new_matched_tokens(request("one", one), 0)
    side.update_state_after_alloc(request("one", one), SimpleNamespace(get_block_ids=lambda: (list(range(9)),)),
                                  matched)
    answer = side.get_num_new_matched_tokens(request("two", two), 0)
    reads = [c.key for job in side.build_connector_meta(new_step("x", [], [])).loads for c in job.chunks]
    if waiting:
        assert answer == (None, False)  # asked again next step
        # The first load done, vLLM caches its blocks: the second finds them in its own cache.
        side.update_connector_output(SimpleNamespace(finished_sending=set(), finished_recving={"one"},
                                                     kv_connector_worker_meta=None))
        assert side.get_num_new_matched_tokens(request("two", two), 3 * CHUNK) == (0, False)
        assert counters.drain()["lookups_deferred"] == 1
        assert len(reads) == len(set(reads)) == 3
    else:
        side.update_state_after_alloc(request("two", two), SimpleNamespace(get_block_ids=lambda: (list(range(9, 18)),)),
                                      answer[0])
        reads += [c.key for job in side.build_connector_meta(new_step("y", [], [])).loads for c in job.chunks]
        assert len(reads) > len(set(reads))  # the planted fault reads the shared chunks twice


def test_a_sync_load_unpins_when_the_worker_reports_it(tmp_path):
    side, index, _ = scheduler(tmp_path, capacity_chunks=4, load_mode="sync")
    first = prompt(1)
    prime(side, "prime", first)
    matched, is_async = side.get_num_new_matched_tokens(request("hit", first), 0)
    assert not is_async
    side.update_state_after_alloc(request("hit", first), SimpleNamespace(get_block_ids=lambda: (list(range(20)),)),
                                  matched)
    assert index.loading_elsewhere(blocks_of(first), "someone-else")
    side.update_connector_output(SimpleNamespace(finished_sending=set(), finished_recving=None,
                                                 kv_connector_worker_meta=KVOffloadWorkerMeta(loaded=["hit"])))
    assert not index.loading_elsewhere(blocks_of(first), "someone-else")


def test_a_chunk_found_damaged_is_forgotten_and_its_file_deleted(tmp_path):
    side, index, _ = scheduler(tmp_path, capacity_chunks=8)
    first = prompt(1)
    prime(side, "prime", first)
    bad = files_of(first)[1]
    side.update_connector_output(SimpleNamespace(finished_sending=set(), finished_recving=set(),
                                                 kv_connector_worker_meta=KVOffloadWorkerMeta(dropped=[bad])))
    assert index.lookup(blocks_of(first)) == CHUNK // BLOCK  # the first chunk's blocks
    assert side.build_connector_meta(new_step("x", [], [])).deletes == [bad]


def test_a_failed_write_leaves_no_chunk_and_tensor_parallel_failures_win(tmp_path):
    side, index, _ = scheduler(tmp_path, capacity_chunks=8)
    first = prompt(1)
    meta = compute(side, "p", first, list(range(9)))
    names = [s.key for s in meta.saves]
    # Rank 0 wrote everything, rank 1 could not write the second chunk.
    report = KVOffloadWorkerMeta(stored=[(k, SIZE, 0) for k in names])
    report.aggregate(KVOffloadWorkerMeta(stored=[(k, SIZE, 0) for k in names if k != names[1]],
                                         store_failed=[(names[1], SIZE, 0)]))
    side.update_connector_output(SimpleNamespace(finished_sending=set(), finished_recving=set(),
                                                 kv_connector_worker_meta=report))
    assert index.lookup(blocks_of(first)) == CHUNK // BLOCK and index.used_bytes == 3 * SIZE


def test_reset_forgets_everything_and_ignores_writes_announced_before_it(tmp_path):
    side, index, _ = scheduler(tmp_path, capacity_chunks=8)
    first = prompt(1)
    meta = compute(side, "p", first, list(range(9)))
    assert side.reset_cache()
    after = side.build_connector_meta(new_step("x", [], []))
    assert after.clear and after.deletes == []
    side.request_finished(request("p", first), [])
    again = compute(side, "p2", first, list(range(9, 18)))  # the same chunks announced anew, not yet written
    worker_reports(side, meta)  # the writes announced before the reset finish after it
    assert index.lookup(blocks_of(first)) == 0 and index.used_bytes == 4 * SIZE  # reserved
    worker_reports(side, again)
    assert index.lookup(blocks_of(first)) == 4 * CHUNK // BLOCK


# -- the worker carries the index's decisions out on real files --------------------------------------------
def worker(tmp_path, blocks=8, **extra):
    """A worker over a CPU cache of two layers and `blocks` blocks (also used by test_worker_gather.py)."""
    from pytest_kvoffload.connector.worker import WorkerSide

    config = ConnectorConfig.from_extra({"store_dir": str(tmp_path), "chunk_tokens": CHUNK, "io_threads": 2, **extra},
                                        BLOCK)
    side = WorkerSide(config, "model=test", tmp_path / "rank0", BLOCK)
    caches = {f"layer{i}": torch.randn(blocks, 2, BLOCK, 2, 8) for i in range(2)}
    side.register_kv_caches(caches)
    return side


def finish(side, req_id):
    """Tell the worker the request is finished and wait until its saves are reported done."""
    deadline = time.time() + 30
    while time.time() < deadline:
        sent, _ = side.get_finished({req_id})
        if sent and req_id in sent:
            return
        time.sleep(0.01)
    raise AssertionError(f"saves of {req_id} never finished")


def test_worker_reports_writes_deletes_on_order_and_clears_after_pending_writes(tmp_path):
    side = worker(tmp_path)
    a, b = keys(2)
    side.start_load_kv(KVOffloadMetadata())
    side.wait_for_save(KVOffloadMetadata(saves=[SaveJob("p", a, [0, 1], 0, 0), SaveJob("p", b, [2, 3], 1, 0)]))
    # A reset arrives while the writes may still be under way: they finish, then every file goes.
    side.start_load_kv(KVOffloadMetadata(clear=True))
    assert list((tmp_path / "rank0").glob("*.kv")) == []
    report = side.worker_meta()
    assert sorted(k for k, _, _ in report.stored) == sorted([a, b])
    assert {size for _, size, _ in report.stored} == {side.layout.file_bytes}
    side.wait_for_save(KVOffloadMetadata(saves=[SaveJob("q", a, [0, 1], 0, 1)]))
    finish(side, "q")
    assert (tmp_path / "rank0" / f"{a}.kv").exists()
    side.start_load_kv(KVOffloadMetadata(deletes=[a]))
    assert not (tmp_path / "rank0" / f"{a}.kv").exists()
    side.shutdown()


def test_busy_time_counts_overlapping_intervals_once_in_any_order():
    from pytest_kvoffload.connector.buffers import BusyTime
    busy = BusyTime()
    assert busy.add(0.0, 2.0) == 2.0
    assert busy.add(1.0, 3.0) == 1.0   # the next step's saves began while these still wrote
    assert busy.add(5.0, 6.0) == 1.0
    assert busy.add(2.5, 5.5) == 2.0   # reported late, bridging two spans: only the gap is new
    assert busy.add(0.5, 1.5) == 0.0


def test_the_byte_count_follows_every_change(tmp_path):
    import random

    rng = random.Random(7)
    index = ChunkIndex(tmp_path, 6 * SIZE, SIZE)
    names = keys(12)
    for step in range(400):
        key, op = rng.choice(names), rng.random()
        if op < 0.4 and index.prepare_store(key):
            if rng.random() < 0.8:
                index.complete_store(key, SIZE, index.generation)
            else:
                index.fail_store(key, index.generation)
        elif op < 0.55:
            index.prepare_load(f"r{step}", [key])
            index.complete_load(f"r{step}")
        elif op < 0.7:
            index.drop(key)
        elif op < 0.72:
            index.reset()
        assert index.used_bytes == SIZE * len(index) <= 6 * SIZE


@pytest.mark.parametrize("load_mode,loadable", [("async", 3 * BLOCK), ("sync", 2 * BLOCK)])
def test_a_prompts_short_last_chunk_is_saved_and_the_whole_prompt_offered(tmp_path, load_mode, loadable):
    side, index, _ = scheduler(tmp_path, capacity_chunks=8, load_mode=load_mode)
    tokens = prompt(5, 3 * BLOCK)  # a whole chunk of two blocks, then one block
    meta = prime(side, "p", tokens)
    blocks = blocks_of(tokens)
    assert [(s.key, len(s.block_ids), s.first_block, s.block_keys) for s in meta.saves] == [
        (blocks[1], 2, 0, blocks[:2]), (blocks[2], 1, 2, blocks[2:])]
    # Asynchronous loads cover the whole prompt (vLLM then computes its last token); a synchronous load
    # stops a block short of it, leaving that token to the step.
    assert side.get_num_new_matched_tokens(request("hit", tokens), 0) == (loadable, load_mode == "async")
    side.update_state_after_alloc(request("hit", tokens), SimpleNamespace(get_block_ids=lambda: ([7, 8, 9],)),
                                  loadable)
    chunks = side.build_connector_meta(new_step("x", [], [])).loads[0].chunks
    assert [(c.key, c.blocks, c.count) for c in chunks] == [(blocks[1], [(0, 7), (1, 8)], 2),
                                                            (blocks[2], [(0, 9)], 1)][:-(-loadable // CHUNK)]

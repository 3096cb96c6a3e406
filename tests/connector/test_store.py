import errno
import os

import numpy as np
import pytest

from pytest_kvoffload.connector.config import ConnectorConfig, ConnectorConfigError
from pytest_kvoffload.connector.counters import Counters
from pytest_kvoffload.connector.io_memory import ALIGN
from pytest_kvoffload.connector.chunk_format import HEADER_SIZE, Layout, checksum
from pytest_kvoffload.connector.store import ChunkStore

LAYOUT = Layout(layers=4, blocks=2, block_bytes=8192)
KEY = "00112233445566778899aabbccddeeff"
OTHER = "ffeeddccbbaa99887766554433221100"


def make_store(path, **kw):
    return ChunkStore(path, kw.pop("fingerprint", "model=a"), kw.pop("layout", LAYOUT), **kw)


def filled(store, value=None):
    buf = store.new_buffer()
    payload = store.payload_view(buf)
    payload[:] = np.random.default_rng(value).integers(0, 255, payload.size, dtype=np.uint8)
    return buf


def test_round_trip_is_byte_exact(tmp_path):
    store = make_store(tmp_path)
    buf = filled(store, 1)
    assert store.write(KEY, buf)
    out = store.new_buffer()
    assert store.read(KEY, out)
    assert np.array_equal(store.payload_view(out), store.payload_view(buf))
    assert out.ctypes.data % ALIGN == 0


def test_file_is_header_plus_padded_payload(tmp_path):
    store = make_store(tmp_path)
    store.write(KEY, filled(store))
    size = os.path.getsize(store.path(KEY))
    assert size == HEADER_SIZE + LAYOUT.payload_bytes and size % ALIGN == 0
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]


def test_counts_bytes_and_amplification(tmp_path):
    counters = Counters()
    store = make_store(tmp_path, counters=counters)
    store.write(KEY, filled(store))
    store.read(KEY, store.new_buffer())
    c = counters.drain()
    assert c["useful_bytes_written"] == LAYOUT.payload_bytes == c["useful_bytes_read"]
    assert c["bytes_read"] == LAYOUT.file_bytes
    assert c["direct_io"] in (0.0, 1.0)


def test_missing_chunk_is_a_counted_miss(tmp_path):
    counters = Counters()
    store = make_store(tmp_path, counters=counters)
    assert not store.read(KEY, store.new_buffer())
    assert counters.drain()["chunks_missing"] == 1


def swap_blocks(data: bytearray) -> bytearray:
    """Two blocks of one layer swapped in place: every byte still there, only their order wrong."""
    first, second = HEADER_SIZE, HEADER_SIZE + LAYOUT.block_bytes
    a, b = data[first:second], data[second:second + LAYOUT.block_bytes]
    data[first:second], data[second:second + LAYOUT.block_bytes] = b, a
    return data


@pytest.mark.parametrize("damage", ["truncate", "flip", "magic", "swap"])
def test_damaged_chunk_is_a_counted_miss(tmp_path, damage):
    counters = Counters()
    store = make_store(tmp_path, counters=counters)
    store.write(KEY, filled(store))
    path = store.path(KEY)
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip":
        data[HEADER_SIZE + 100] ^= 0xFF
    elif damage == "swap":
        data = swap_blocks(data)
    else:
        data[:8] = b"XXXXXXXX"
    path.write_bytes(bytes(data))
    assert not store.read(KEY, store.new_buffer())
    assert counters.drain()["chunks_corrupt"] == 1
    # The file stays until the index, told by the worker, has it deleted (test_index).
    store.delete(KEY)
    assert not path.exists()


def test_chunk_of_another_model_is_ignored(tmp_path):
    counters = Counters()
    writer = make_store(tmp_path, fingerprint="model=a")
    writer.write(KEY, filled(writer))
    reader = make_store(tmp_path, fingerprint="model=b", counters=counters)
    assert not reader.read(KEY, reader.new_buffer())
    assert counters.drain()["chunks_foreign"] == 1


@pytest.mark.parametrize("code,counter", [(errno.ENOSPC, "write_errors_full"),
                                          (errno.EROFS, "write_errors_read_only"),
                                          (errno.EACCES, "write_errors_read_only")])
def test_failed_write_is_declined_and_leaves_no_temporary(tmp_path, monkeypatch, code, counter):
    # Root ignores permission bits, so a read-only store is simulated at the system call.
    counters = Counters()
    store = make_store(tmp_path, counters=counters)

    def refuse(path, flags, mode=0o777):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "open", refuse)
    assert not store.write(KEY, filled(store))
    monkeypatch.undo()
    c = counters.drain()
    assert c["writes_declined"] == 1 and c[counter] == 1
    assert list(tmp_path.iterdir()) == []


def test_full_disk_mid_write_removes_the_temporary(tmp_path, monkeypatch):
    counters = Counters()
    store = make_store(tmp_path, counters=counters)

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    assert not store.write(KEY, filled(store))
    monkeypatch.undo()
    assert counters.drain()["write_errors_full"] == 1
    assert list(tmp_path.iterdir()) == []


def vanish(root):
    """The store folder removed under a running store, as a cleanup job or an operator would."""
    for p in root.iterdir():
        p.unlink()
    root.rmdir()


def test_a_vanished_folder_is_recreated_and_saves_resume(tmp_path):
    counters = Counters()
    root = tmp_path / "store"
    store = make_store(root, counters=counters)
    store.write(KEY, filled(store))
    vanish(root)
    assert not store.read(KEY, store.new_buffer())       # what was there is gone: a counted miss
    assert store.write(OTHER, filled(store, 2))          # the folder is made again and the save lands
    out = store.new_buffer()
    assert store.read(OTHER, out)
    c = counters.drain()
    assert c["store_recreated"] == 1 and c["chunks_missing"] == 1 and "write_errors_vanished" not in c
    assert not store.path(KEY).exists() and root.is_dir()


def test_a_save_that_finds_the_folder_gone_lands_when_another_thread_made_it_again(tmp_path, monkeypatch):
    # Two I/O threads save as the folder vanishes: both fail to open, one makes the folder again first.
    counters = Counters()
    root = tmp_path / "store"
    store = make_store(root, counters=counters)
    root.rmdir()
    real_open = os.open

    def open_while_another_thread_recreates(path, *args, **kwargs):
        try:
            return real_open(path, *args, **kwargs)
        except FileNotFoundError:
            root.mkdir(exist_ok=True)  # meanwhile, the other thread made it again
            raise

    monkeypatch.setattr(os, "open", open_while_another_thread_recreates)
    assert store.write(OTHER, filled(store))
    c = counters.drain()
    assert "writes_declined" not in c and "store_recreated" not in c  # the other thread counts it


def test_a_folder_that_cannot_be_recreated_declines_saves(tmp_path, monkeypatch):
    counters = Counters()
    root = tmp_path / "store"
    store = make_store(root, counters=counters)
    root.rmdir()

    def refused(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(os, "mkdir", refused)
    assert not store.write(OTHER, filled(store))
    assert counters.drain()["write_errors_vanished"] == 1


def test_clear_empties_the_store(tmp_path):
    store = make_store(tmp_path)
    store.write(KEY, filled(store))
    store.write(OTHER, filled(store))
    assert store.clear() == 2 and not store.path(KEY).exists()


def test_checksum_sees_one_flipped_bit():
    data = np.zeros(4096, dtype=np.uint8)
    before = checksum(data)
    data[77] = 1
    assert checksum(data) != before


def test_checksum_sees_two_blocks_swapped():
    # The former checksum (a sum of 64-bit words) gave both orders the same value.
    data = np.random.default_rng(3).integers(0, 255, 4 * 8192, dtype=np.uint8)
    swapped = np.concatenate([data[8192:16384], data[:8192], data[16384:]])
    assert checksum(swapped) != checksum(data)
    assert int(np.add.reduce(swapped.view(np.uint64), dtype=np.uint64)) == \
        int(np.add.reduce(data.view(np.uint64), dtype=np.uint64))


def test_config_from_extra():
    config = ConnectorConfig.from_extra({"store_dir": "/x", "direct_io": "false"}, 128)
    assert config.chunk_tokens == 256 and not config.direct_io


@pytest.mark.parametrize("extra,match", [
    ({}, "store_dir is required"),
    ({"store_dir": "/x", "chunk_tokens": 100}, "multiple of the block size 128"),
    ({"store_dir": "/x", "bogus": 1}, "unknown option"),
    ({"store_dir": "/x", "read_gbps": 1}, "read_gbps is a test knob .* of the test-only connector pytest_kvoffload.rigged"),
    ({"store_dir": "/x", "admission": "eager"}, "admission 'eager' must be one of queue, static, online, always, never"),
    ({"store_dir": "/x", "io_threads": "abc"}, "io_threads .abc. must be a whole number of threads"),
    ({"store_dir": "/x", "read_latency_ms": 5}, "read_latency_ms is a test knob"),
    ({"store_dir": "/x", "fault": "zero"}, "fault is a test knob"),
    ({"store_dir": "/x", "admission": "static:scale=1.3"}, "is a planted rule of the test-only connector"),
])
def test_config_errors_name_the_option(extra, match):
    with pytest.raises(ConnectorConfigError, match=match):
        ConnectorConfig.from_extra(extra, 128)


def test_counters_carry_histogram_observations_once():
    counters = Counters()
    counters.observe("load_duration_seconds", 0.02)
    counters.observe("load_duration_seconds", 0.03)
    counters.add("chunks_read", 2)
    assert counters.drain() == {"load_duration_seconds": [0.02, 0.03], "chunks_read": 2.0}
    assert counters.drain() == {}


def test_connector_stats_join_histogram_observations_across_workers():
    pytest.importorskip("vllm")
    from pytest_kvoffload.connector.prom import KVOffloadStats
    stats = KVOffloadStats(data={"load_size_bytes": [1e6], "chunks_read": 1.0})
    stats.aggregate(KVOffloadStats(data={"load_size_bytes": [2e6], "chunks_read": 2.0}))
    assert stats.data == {"load_size_bytes": [1e6, 2e6], "chunks_read": 3.0}
    assert stats.reduce() == {"chunks_read": 3.0, "load_size_bytes_count": 2}


# -- recycled files: a removed chunk's file is written over by a later save ---------------------------------
def free_files(root):
    return sorted(p for p in root.iterdir() if p.name.startswith(".free-"))


@pytest.mark.parametrize("keep_free", [None, 0])
def test_a_removed_chunks_file_is_written_over_by_the_next_save(tmp_path, keep_free):
    counters = Counters()
    store = make_store(tmp_path, counters=counters, keep_free=keep_free)
    store.write(KEY, filled(store, 1))
    inode = os.stat(store.path(KEY)).st_ino
    store.delete(KEY)
    assert not store.path(KEY).exists() and len(free_files(tmp_path)) == (0 if keep_free == 0 else 1)
    buf = filled(store, 2)
    assert store.write(OTHER, buf)
    out = store.new_buffer()
    assert store.read(OTHER, out) and np.array_equal(store.payload_view(out), store.payload_view(buf))
    reused = counters.drain().get("chunks_written_over_free", 0)
    # keep_free=0 is the control: nothing kept, so the save makes a new file and the count stays put.
    assert reused == (0 if keep_free == 0 else 1)
    if keep_free != 0:
        assert os.stat(store.path(OTHER)).st_ino == inode  # the same file (a new one may get the number too)
    assert free_files(tmp_path) == [] and not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]


def test_a_free_file_of_another_size_is_removed_not_written_over(tmp_path):
    counters = Counters()
    store = make_store(tmp_path, counters=counters)
    store.write(KEY, filled(store))
    store.delete(KEY)
    (free,) = free_files(tmp_path)
    os.truncate(free, ALIGN)  # as a foreign or damaged chunk's file would be
    buf = filled(store, 3)
    assert store.write(OTHER, buf)
    out = store.new_buffer()
    assert store.read(OTHER, out) and np.array_equal(store.payload_view(out), store.payload_view(buf))
    assert "chunks_written_over_free" not in counters.drain() and free_files(tmp_path) == []


def test_clear_keeps_at_most_keep_free_files_and_a_new_store_removes_them(tmp_path):
    store = make_store(tmp_path, keep_free=1)
    for i in range(3):
        store.write(f"{i:032x}", filled(store, i))
    assert store.clear() == 3 and len(free_files(tmp_path)) == 1
    assert not list(tmp_path.glob("*.kv"))
    make_store(tmp_path)  # a restarted server does not know them
    assert free_files(tmp_path) == []
    store = make_store(tmp_path)
    store.write(KEY, filled(store))
    store.delete(KEY)
    store.drop_free()
    assert list(tmp_path.iterdir()) == []


def test_free_files_lost_with_a_vanished_folder_do_not_stop_saves(tmp_path):
    counters = Counters()
    root = tmp_path / "store"
    store = make_store(root, counters=counters)
    store.write(KEY, filled(store))
    store.delete(KEY)
    vanish(root)
    assert store.write(OTHER, filled(store, 2))
    c = counters.drain()
    assert c["store_recreated"] == 1 and "chunks_written_over_free" not in c and "writes_declined" not in c


@pytest.mark.parametrize("damage", [None, "flip", "magic"])
def test_a_reads_use_runs_after_the_header_checks_and_before_the_checksum(tmp_path, monkeypatch, damage):
    from pytest_kvoffload.connector import store as store_module
    store = make_store(tmp_path)
    store.write(KEY, filled(store))
    path = store.path(KEY)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[HEADER_SIZE + 100] ^= 0xFF
    elif damage == "magic":
        data[:8] = b"XXXXXXXX"
    path.write_bytes(bytes(data))
    seen = []
    monkeypatch.setattr(store_module, "checksum", lambda payload: seen.append("checksum") or checksum(payload))
    ok = store.read(KEY, store.new_buffer(), use=lambda: seen.append("use"))
    assert ok is (damage is None)
    # A header that fails is never used; a payload that fails its checksum was, and the False says undo it.
    assert seen == ([] if damage == "magic" else ["use", "checksum"])

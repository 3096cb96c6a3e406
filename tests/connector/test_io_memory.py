"""Chunk buffers on huge pages (connector/io_memory.py): aligned for O_DIRECT, one physically contiguous run
where the kernel grants huge pages, ordinary pages when asked or when small; the store reports which."""

import os
from pathlib import Path

import pytest

from pytest_kvoffload.connector.config import ConnectorConfig, ConnectorConfigError
from pytest_kvoffload.connector.io_memory import ALIGN, HUGE_PAGE, MIN_HUGE, aligned_buffer, on_huge_pages
from pytest_kvoffload.connector.chunk_format import Layout
from pytest_kvoffload.connector.store import ChunkStore

CHUNK = (1 << 20) + ALIGN  # a 1 MiB chunk file: header and payload
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_granted() -> bool:
    """Transparent huge pages for memory that asks (madvise) or for all (always)."""
    try:
        return "[never]" not in THP.read_text()
    except OSError:
        return False


def test_a_chunk_buffer_is_aligned_zeroed_and_starts_a_huge_page():
    buffer = aligned_buffer(CHUNK)
    assert buffer.size == CHUNK and buffer.ctypes.data % ALIGN == 0
    assert buffer.ctypes.data % HUGE_PAGE == 0  # the whole chunk inside one 2 MiB page
    assert not buffer.any()


@pytest.mark.skipif(not thp_granted(), reason="transparent huge pages are off on this machine")
def test_the_kernel_backs_a_chunk_buffer_with_a_huge_page():
    assert on_huge_pages(aligned_buffer(CHUNK))


@pytest.mark.skipif(not thp_granted(), reason="transparent huge pages are off on this machine")
def test_ordinary_pages_when_asked_even_where_numpy_would_take_huge_ones():
    # numpy marks its own arrays of 4 MiB and more for huge pages (its default on Linux), so a buffer of
    # ordinary pages must not be one of them.
    plain = aligned_buffer(4 << 20, huge=False)
    plain[:] = 1
    assert not on_huge_pages(plain)
    # The control: the same size asked for huge pages gets one now, on this machine.
    assert on_huge_pages(aligned_buffer(4 << 20))


def test_ordinary_pages_when_asked_or_small():
    plain = aligned_buffer(CHUNK, huge=False)
    assert plain.ctypes.data % ALIGN == 0 and plain.size == CHUNK and not on_huge_pages(plain)
    small = aligned_buffer(MIN_HUGE - ALIGN)
    assert small.ctypes.data % ALIGN == 0 and not on_huge_pages(small)


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT here")
def test_a_huge_page_buffer_round_trips_a_chunk_with_o_direct(tmp_path):
    store = ChunkStore(tmp_path, "model=a", Layout(layers=8, blocks=2, block_bytes=65536))
    buffer = store.new_buffer()
    store.payload_view(buffer)[:] = 7
    assert store.write("00" * 16, buffer, block_keys=["01" * 16, "02" * 16])
    out = store.new_buffer()
    assert store.read("00" * 16, out) and (store.payload_view(out) == 7).all()
    assert store.counters.drain()["buffers_on_huge_pages"] == (1.0 if thp_granted() else 0.0)


def test_the_store_uses_ordinary_pages_when_told(tmp_path):
    store = ChunkStore(tmp_path, "model=a", Layout(layers=8, blocks=2, block_bytes=65536), huge_pages=False)
    assert not store.buffers_on_huge_pages and not on_huge_pages(store.new_buffer())


def test_huge_pages_option_is_a_switch_with_a_one_line_error(tmp_path):
    assert ConnectorConfig.from_extra({"store_dir": str(tmp_path)}, 128).huge_pages is True
    assert ConnectorConfig.from_extra({"store_dir": str(tmp_path), "huge_pages": "off"}, 128).huge_pages is False
    with pytest.raises(ConnectorConfigError, match="huge_pages 'maybe' must be true or false"):
        ConnectorConfig.from_extra({"store_dir": str(tmp_path), "huge_pages": "maybe"}, 128)

"""The chunk store: one file per chunk holding every layer's blocks, read and written in one piece.

A chunk is up to `Layout.blocks` consecutive KV blocks of one prompt (the last chunk of a prompt may hold
fewer), so that a prefix is stored and matched block by block while the drive still sees large files.
The file's format (a 4 KiB header, then the payload padded to 4 KiB) is chunk_format.py's.
Writes go to a temporary name in the store folder and are renamed into place, so a reader never sees
half a chunk. A removed chunk's file is kept, up to a bound, under a free name and written over by a
later save: on ext4 a new file costs the writer about 0.4 ms of CPU a 1 MiB chunk (inode and block
allocation) where writing over an existing one costs 0.06 (2-core VM, docs/notes/2026-11-30-recycling.md),
and where the engine holds the cores that CPU is what a save waits for. Anything wrong with a file (missing, short, corrupt, written for another model) is a
miss: counted, logged once, and the tokens are recomputed; the index (index.ChunkIndex) then forgets it
and has its file removed. The store keeps no list of its own: what is stored, and what to evict, is the
index's to decide.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import threading
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np

from pytest_kvoffload.connector.chunk_format import (FORMAT_VERSION, HEADER, HEADER_SIZE, MAGIC, Layout,
                                                     checksum)
from pytest_kvoffload.connector.counters import Counters
from pytest_kvoffload.connector.io_memory import ALIGN, aligned_buffer, on_huge_pages

log = logging.getLogger("pytest_kvoffload.connector")

SUFFIX = ".kv"
FREE_PREFIX = ".free-"
# Recycled files kept at most (bytes beyond the index's capacity; the rest of a clear is unlinked).
KEEP_FREE_BYTES = 64 << 20


class ChunkStore:
    def __init__(self, root: Path, fingerprint: str, layout: Layout, direct_io: bool = True,
                 counters: Counters | None = None, keep_free: int | None = None, huge_pages: bool = True) -> None:
        self.root = Path(root)
        self.huge_pages = huge_pages  # chunk buffers on huge pages where the kernel allows (io_memory.py)
        self.fingerprint = hashlib.sha256(fingerprint.encode()).digest()
        self.layout = layout
        self.counters = counters or Counters()
        self._lock = threading.Lock()
        self._logged: set[str] = set()
        self._free: list[Path] = []  # removed chunks' files, ready to be written over
        self._free_lock = threading.Lock()
        self._free_serial = 0
        self.keep_free = keep_free if keep_free is not None else max(1, KEEP_FREE_BYTES // layout.file_bytes)
        self.root.mkdir(parents=True, exist_ok=True)
        self.direct_io = direct_io and self._probe_direct_io()
        self.counters.set("direct_io", 1.0 if self.direct_io else 0.0)
        # Whether the kernel grants the chunk buffers huge pages, asked once of a buffer made now: reading
        # /proc/self/smaps takes milliseconds in the engine's process, so never in a load.
        self.buffers_on_huge_pages = on_huge_pages(self.new_buffer())
        self.counters.set("buffers_on_huge_pages", 1.0 if self.buffers_on_huge_pages else 0.0)
        self._remove_temporaries()

    # -- bookkeeping ------------------------------------------------------------------------------
    def path(self, key: str) -> Path:
        return self.root / f"{key}{SUFFIX}"

    def _remove_temporaries(self) -> None:
        """A temporary file left by a crashed writer is never a valid chunk; free files of an earlier server
        are not known to this one."""
        try:
            with os.scandir(self.root) as it:
                for entry in it:
                    if entry.name.startswith((".tmp-", FREE_PREFIX)):
                        try:
                            os.unlink(entry.path)
                        except OSError:
                            pass
        except OSError as exc:
            self._once("scan", f"cannot list store folder {self.root}: {exc}")

    def _once(self, kind: str, message: str) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning("kvoffload store: %s (logged once)", message)

    def _probe_direct_io(self) -> bool:
        probe = self.root / ".tmp-direct-probe"
        try:
            fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o644)
            try:
                os.write(fd, memoryview(aligned_buffer(ALIGN)))
            finally:
                os.close(fd)
            return hasattr(os, "O_DIRECT")
        except OSError:
            self._once("direct", f"O_DIRECT not supported under {self.root}; using buffered I/O and dropping cached pages")
            return False
        finally:
            try:
                os.unlink(probe)
            except OSError:
                pass

    # -- writing ----------------------------------------------------------------------------------
    def new_buffer(self) -> np.ndarray:
        """A buffer for one chunk file, to read into or write from (io_memory.aligned_buffer)."""
        return aligned_buffer(self.layout.file_bytes, huge=self.huge_pages)

    def payload_view(self, buffer: np.ndarray, blocks: int | None = None) -> np.ndarray:
        """The payload of a chunk of `blocks` blocks (a whole chunk by default) in `buffer`."""
        return buffer[HEADER_SIZE:HEADER_SIZE + self.layout.payload_bytes_for(blocks or self.layout.blocks)]

    def seal(self, key: str, buffer: np.ndarray, first_block: int = 0, block_keys: list[str] | None = None) -> None:
        """Put the header, with the payload's checksum, in front of a chunk gathered into `buffer` (from
        new_buffer): len(block_keys) blocks (a whole chunk where None, keyed by `key` alone). The worker seals
        what it gathers as it gathers it, while the payload is in the core's caches, on the CPU build's step
        thread: the I/O threads then only write (writes paired to the drive 0.99 against 0.89 where they
        sealed, 12 passes each: notes/2026-12-03-load-overheads.md)."""
        blocks = len(block_keys) if block_keys else self.layout.blocks
        payload = self.payload_view(buffer, blocks)
        header = HEADER.pack(MAGIC, FORMAT_VERSION, self.fingerprint, bytes.fromhex(key), payload.size,
                              checksum(payload), self.layout.layers, blocks, self.layout.block_bytes, first_block)
        header += b"".join(bytes.fromhex(k) for k in block_keys or ())
        buffer[:HEADER_SIZE] = 0
        buffer[:len(header)] = np.frombuffer(header, dtype=np.uint8)

    def write(self, key: str, buffer: np.ndarray, first_block: int = 0, block_keys: list[str] | None = None,
              sealed: bool = False) -> bool:
        """Store a chunk gathered into `buffer` as `seal` describes it, sealed here unless `sealed` says it
        was. False: declined. Room was made by the index when it announced the store."""
        blocks = len(block_keys) if block_keys else self.layout.blocks
        size = self.layout.file_bytes_for(blocks)
        payload_bytes = self.layout.payload_bytes_for(blocks)
        if not sealed:
            self.seal(key, buffer, first_block, block_keys)
        started = time.perf_counter()
        error = self._write_file(key, buffer, size)
        if error is not None and error.errno == errno.ENOENT:
            # The folder was removed under us: make it again (unless another I/O thread just did) and write
            # once more. Failing that, the second error declines the save.
            self._recreate()
            error = self._write_file(key, buffer, size)
        if error is not None:
            self.counters.add("writes_declined")
            kind = {errno.ENOSPC: "full", errno.EROFS: "read-only", errno.EACCES: "read-only",
                    errno.ENOENT: "vanished"}.get(error.errno, "write-error")
            self.counters.add(f"write_errors_{kind.replace('-', '_')}")
            self._once(kind, f"cannot write chunk to {self.root} ({error.strerror}); saves are skipped")
            return False
        self.counters.add("save_seconds", time.perf_counter() - started)
        self.counters.add("bytes_written", size)
        self.counters.add("useful_bytes_written", payload_bytes)
        self.counters.add("chunks_written")
        return True

    def _write_file(self, key: str, buffer: np.ndarray, size: int) -> OSError | None:
        """Write under a name no reader looks at, then rename into place: readers never see a partial chunk.
        That name is a free file's where one of this size is kept (written over in place; one rename), else
        a new temporary file's."""
        target = self._claim_free(size)
        reused = target is not None
        if target is None:
            target = self.root / f".tmp-{key}-{threading.get_ident()}"
        try:
            flags = (os.O_WRONLY if reused else os.O_CREAT | os.O_WRONLY | os.O_TRUNC) | (
                os.O_DIRECT if self.direct_io else 0)
            fd = os.open(target, flags, 0o644)
            try:
                view = memoryview(buffer[:size])
                written = 0
                while written < size:
                    written += os.write(fd, view[written:])
                if not self.direct_io:
                    os.fdatasync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            os.replace(target, self.path(key))
        except OSError as exc:
            try:
                os.unlink(target)
            except OSError:
                pass
            return exc
        if reused:
            self.counters.add("chunks_written_over_free")
        return None

    def _claim_free(self, size: int) -> Path | None:
        """Take a kept free file of `size` bytes for this thread alone; None where there is none."""
        while True:
            with self._free_lock:
                if not self._free:
                    return None
                free = self._free.pop()
            try:
                if os.stat(free).st_size == size:
                    return free
                os.unlink(free)  # another layout's (a foreign or damaged chunk): not ours to write over
            except OSError:
                pass  # gone (the folder was removed): try the next

    def _retire(self, path: Path) -> bool:
        """Keep a removed chunk's file for a later save, or unlink it once enough are kept."""
        with self._free_lock:
            keep = len(self._free) < self.keep_free
            if keep:
                self._free_serial += 1
                free = self.root / f"{FREE_PREFIX}{self._free_serial}"
        try:
            if keep:
                os.rename(path, free)
                with self._free_lock:
                    self._free.append(free)
            else:
                os.unlink(path)
            return True
        except OSError:
            return False

    def _recreate(self) -> None:
        """The store folder vanished (a cleanup job, an operator): make it again, empty, and carry on.
        Counted and logged by the one thread that makes it. The index still lists the lost chunks; their
        loads fail as missing and it forgets them."""
        try:
            self.root.mkdir(parents=True)
        except OSError:  # FileExistsError: another I/O thread made it first; otherwise the retry fails too
            return
        self.counters.add("store_recreated")
        log.warning("kvoffload: store folder %s vanished; recreated it empty", self.root)

    # -- reading ----------------------------------------------------------------------------------
    def read(self, key: str, buffer: np.ndarray, blocks: int | None = None, used: int | None = None,
             io_slot=None, use=lambda: None) -> bool:
        """Fill `buffer` (from new_buffer) with the chunk of `blocks` blocks (a whole chunk by default), of
        which the load uses `used` (all by default: the rest is read for the checksum, and counted as read
        but not useful); False on any fault, which then counts as a miss. `io_slot` (a semaphore), where
        given, is held for the drive's part alone: the caller's bound on reads in flight. `use` as in
        finish_read. A caller that moves the bytes itself (connector/aio_loads.py) calls open_chunk, then
        finish_read."""
        blocks = blocks or self.layout.blocks
        size = self.layout.file_bytes_for(blocks)
        started = time.perf_counter()
        fd = self.open_chunk(key, blocks)
        if fd is None:
            return False
        try:
            got = 0
            view = memoryview(buffer[:size])
            with io_slot or nullcontext():
                while got < size:
                    n = os.preadv(fd, [view[got:]], got)
                    if n <= 0:
                        break
                    got += n
        except OSError as exc:
            return self.read_failed(key, exc)
        finally:
            os.close(fd)
        return self.finish_read(key, buffer, blocks, got, started, used, use)

    def open_chunk(self, key: str, blocks: int) -> int | None:
        """The chunk file's descriptor for reading (O_DIRECT where the store uses it), its size checked;
        None, counted and logged, where it is missing, unreadable or of the wrong size."""
        path = self.path(key)
        try:
            fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if self.direct_io else 0))
        except FileNotFoundError:
            self.counters.add("chunks_missing")
            self._once("missing", f"chunk {key} vanished between lookup and load")
            return None
        except OSError as exc:
            self.counters.add("read_errors")
            self._once("open", f"cannot open {path}: {exc.strerror}")
            return None
        actual, size = os.fstat(fd).st_size, self.layout.file_bytes_for(blocks)
        if actual != size:
            os.close(fd)
            self._corrupt(key, f"{actual} bytes, expected {size}")
            return None
        return fd

    def read_failed(self, key: str, exc: OSError) -> bool:
        self.counters.add("read_errors")
        self._once("read", f"cannot read {self.path(key)}: {exc.strerror}")
        return False

    def finish_read(self, key: str, buffer: np.ndarray, blocks: int, got: int, started: float,
                    used: int | None = None, use=lambda: None) -> bool:
        """Check a chunk whose file's `got` bytes were read into `buffer` since `started` (perf_counter)
        and count it read; False, counted, on a fault. `use()` runs between the header's checks and the
        checksum, which then finds the payload in the core's caches (the worker's scatter: 0.27 ms of CPU a
        1 MiB chunk against 0.34 checked first, docs/notes/2026-12-02-scatter-first.md); False then means
        what it did must be undone."""
        size = self.layout.file_bytes_for(blocks)
        if got < size:
            return self._corrupt(key, "short read")
        magic, version, fingerprint, stored_key, length, stored_sum, layers, stored_blocks, block_bytes, _ = \
            HEADER.unpack_from(buffer[:HEADER.size].tobytes())
        if magic != MAGIC or version != FORMAT_VERSION:
            return self._corrupt(key, "not a kvoffload chunk of this format version")
        if fingerprint != self.fingerprint or (layers, stored_blocks, block_bytes) != (
                self.layout.layers, blocks, self.layout.block_bytes):
            # Keys are seeded with the fingerprint, so this file can serve no server: the index removes it.
            self.counters.add("chunks_foreign")
            self._once("foreign", f"chunk {key} was written for another model or layout; removed")
            return False
        payload = self.payload_view(buffer, blocks)
        if stored_key != bytes.fromhex(key) or length != payload.size:
            return self._corrupt(key, "checksum mismatch")
        use_started = time.perf_counter()
        use()
        used_s = time.perf_counter() - use_started
        if checksum(payload) != stored_sum:
            return self._corrupt(key, "checksum mismatch")
        self.after_read(size)
        self.counters.add("load_seconds", time.perf_counter() - started - used_s)
        self.counters.add("bytes_read", size)
        self.counters.add("useful_bytes_read", self.layout.payload_bytes_for(used or blocks))
        self.counters.add("chunks_read")
        return True

    def after_read(self, nbytes: int) -> None:
        """Called once a chunk is read and checked, inside its load time: nothing here; the test-only
        connector's emulated drive holds the read there (rigged/emulated_drive.py)."""

    def _corrupt(self, key: str, why: str) -> bool:
        self.counters.add("chunks_corrupt")
        self._once("corrupt", f"chunk {key} is damaged ({why}); removed and recomputed")
        return False

    def delete(self, key: str) -> None:
        """Remove one chunk (the index evicted it or found it damaged); a missing file is fine."""
        self._retire(self.path(key))

    def drop_free(self) -> None:
        """Unlink the kept free files (a probe's end, a server's shutdown)."""
        with self._free_lock:
            free, self._free = self._free, []
        for path in free:
            try:
                os.unlink(path)
            except OSError:
                pass

    def clear(self) -> int:
        """Remove every chunk (vLLM's reset_external); returns how many were removed."""
        removed = 0
        try:
            names = os.listdir(self.root)
        except OSError:
            return 0
        for name in names:
            if name.endswith(SUFFIX) and not name.startswith("."):
                removed += self._retire(self.root / name)
        return removed

"""Disk tiers that read the disk: each tier folder's I/O mode, its files' page-cache residency, and the drop.

A disk tier that reads with O_DIRECT (our store, vLLM's fs tier where the filesystem allows it) reads the
drive. A buffered one (LMCache's fs adapter by default, vLLM's fs tier on overlayfs or some NFS mounts)
may be served from the page cache, where a "disk hit" is a memory copy. For those the harness drops the
tier's files from the page cache before each tier-only round (posix_fadvise DONTNEED, no privileges) and
records what was resident before and after (mincore), so a round is a disk read by proof, not by hope.
One helper for every disk backend: the folders and the O_DIRECT request are what the backend declares
(serve/backend.py ServerSpec.tier_folders, direct_io).
"""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

from pytest_kvoffload.core import machine

PAGE = mmap.PAGESIZE


def direct_io_works(folder: Path) -> bool:
    """Whether a file in `folder` (or its nearest existing parent) opens with O_DIRECT."""
    path = machine.nearest_existing(folder)
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    probe = path / f".kvoffload-direct-probe-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_TRUNC | flag, 0o644)
        os.close(fd)
        return True
    except OSError:
        return False
    finally:
        try:
            probe.unlink()
        except OSError:
            pass


def io_mode(folder: Path, configured_direct: bool = True) -> str:
    """'O_DIRECT' or 'buffered': what the tier's reads go through, as far as configuration and the
    filesystem decide it."""
    return "O_DIRECT" if configured_direct and direct_io_works(folder) else "buffered"


_libc = None


def _c():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL("libc.so.6", use_errno=True)
        _libc.mmap.restype = ctypes.c_void_p
        _libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        _libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return _libc


def resident_bytes(path: Path) -> tuple[int, int]:
    """(bytes of the file in the page cache, file size), by mincore over a read-only mapping."""
    size = os.path.getsize(path)
    if size == 0:
        return 0, 0
    libc = _c()
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
        try:
            pages = (size + PAGE - 1) // PAGE
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
            resident = sum(1 for v in vec if v & 1)
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    return min(size, resident * PAGE), size


def _files(folders: list[Path]):
    for folder in folders:
        if Path(folder).is_dir():
            for root, _, names in os.walk(folder):
                for name in names:
                    yield Path(root) / name


def residency(folders: list[Path]) -> dict:
    """Page-cache residency of every file under the folders: {'files', 'bytes', 'resident_bytes'}."""
    files = resident = total = 0
    for path in _files(folders):
        try:
            r, t = resident_bytes(path)
        except OSError:
            continue  # removed or replaced under us: a store evicts while we look
        files, resident, total = files + 1, resident + r, total + t
    return {"files": files, "bytes": total, "resident_bytes": resident}


def drop(folders: list[Path]) -> dict:
    """Drop every file under the folders from the page cache (dirty pages are written first, so the drop
    holds); returns the residency before and after."""
    before = residency(folders)
    for path in _files(folders):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass
        finally:
            os.close(fd)
    return {"before": before, "after": residency(folders)}

"""The chunk index: which blocks the store holds, in which chunk file, with the files in LRU order; the one
owner of what is stored and evicted.

Prefixes are matched block by block (each block's key chains every token up to its end), and stored in
chunk files of up to a chunk's blocks (a prompt's last chunk may hold fewer). A block stored in two files
(a prompt's short last chunk, later a whole chunk of a longer prompt) is served from the newer; a file
left serving no block is removed.

It lives in the scheduler half, in the shape of vLLM's offloading manager (vllm/v1/kv_offload/base.py):
lookups read it, a load pins its chunks until the worker reports it done (so eviction under capacity
pressure never turns a promised hit into a recompute), a store is announced (room made, bytes reserved)
and completed when the worker reports the file in place, and eviction, damaged-chunk removal and reset
are decided here and sent to the workers as deletions. Workers only read, write and delete files.
"""

from __future__ import annotations

import logging
import os
import struct
from collections import OrderedDict
from pathlib import Path

from pytest_kvoffload.connector.counters import Counters
from pytest_kvoffload.connector.chunk_format import FORMAT_VERSION, read_header
from pytest_kvoffload.connector.store import SUFFIX

log = logging.getLogger("pytest_kvoffload.connector")


class ChunkIndex:
    def __init__(self, root: Path, capacity_bytes: int, chunk_bytes: int | None = None,
                 counters: Counters | None = None) -> None:
        self.capacity_bytes = capacity_bytes
        self.counters = counters or Counters()
        self._present: OrderedDict[str, int] = OrderedDict()  # file key -> bytes, least recently used first
        self._file_blocks: dict[str, list[str]] = {}  # file key -> its blocks' keys, in order
        self._where: dict[str, tuple[str, int]] = {}  # block key -> (file key, position in the file)
        self._serving: dict[str, int] = {}  # file key -> how many blocks _where sends to it
        self._pending: dict[str, tuple[int, list[str]]] = {}  # file key -> (bytes reserved, block keys)
        # Bytes of both, kept as they change: summing 64k entries on every store would cost the scheduler.
        self._used = 0
        self._pins: dict[str, int] = {}  # file key -> loads in flight reading it
        self._loads: dict[str, list[str]] = {}  # req_id -> the files its load pinned
        self._deletes: list[str] = []  # files the workers remove at their next step
        self._clear = False
        self._declined_logged = False
        # Bumped by reset: a store announced before it reports into an index that no longer expects it.
        self.generation = 0
        self._scan(Path(root))
        # Bytes reserved for a file about to be written: the largest file seen (the workers' reports are
        # the truth); before one arrives, the engine's KV geometry (connector.chunk_file_bytes) stands in.
        self.chunk_bytes = max([chunk_bytes or 0, *self._present.values()])

    def _scan(self, root: Path) -> None:
        """What a previous server left on disk, oldest first: a restarted server still serves it. Files of
        an older format (whole chunks under one chunk key, before blocks were matched one by one) cannot
        answer a block lookup: counted, logged once, and left in place for their owner to remove."""
        entries, old = [], 0
        try:
            with os.scandir(root) as it:
                for entry in it:
                    if not entry.name.endswith(SUFFIX) or entry.name.startswith("."):
                        continue
                    try:
                        st = entry.stat()
                        header = read_header(Path(entry.path))
                    except (OSError, ValueError, struct.error):
                        continue
                    if header["version"] != FORMAT_VERSION:
                        old += 1
                    elif header["block_keys"]:
                        entries.append((st.st_mtime, entry.name[:-len(SUFFIX)], st.st_size, header["block_keys"]))
        except OSError:
            pass
        for _, key, size, blocks in sorted(entries):
            self._add_file(key, size, blocks)
        if old:
            self.counters.set("chunks_old_format", float(old))
            log.warning("kvoffload index: %s holds %d chunk files of an older format (version < %d, whole "
                        "chunks); they are not read: remove them or point store_dir at another folder", root,
                        old, FORMAT_VERSION)

    def _add_file(self, key: str, size: int, blocks: list[str]) -> None:
        """A file in place: each of its blocks now served from it (the newest file wins)."""
        self._present[key] = size  # a new key: the most recently used
        self._used += size
        self._file_blocks[key] = blocks
        self._serving[key] = 0
        for position, block in enumerate(blocks):
            before = self._where.get(block)
            self._where[block] = (key, position)
            self._serving[key] += 1
            if before is not None and before[0] != key:
                self._serving[before[0]] -= 1
                if self._serving[before[0]] == 0 and not self._pins.get(before[0]):
                    self._remove(before[0])
                    self._deletes.append(before[0])
                    self.counters.add("chunks_superseded")

    def _remove(self, key: str) -> None:
        """Forget one file and the blocks it serves (the caller sends the deletion)."""
        self._used -= self._present.pop(key)
        self._serving.pop(key, None)
        for block in self._file_blocks.pop(key, ()):
            if self._where.get(block, ("",))[0] == key:
                del self._where[block]

    # -- reading the index ----------------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        return self._used

    def __contains__(self, key: str) -> bool:
        """A stored file's key (tests and tools)."""
        return key in self._present

    def __len__(self) -> int:
        return len(self._present)

    def lookup(self, keys: list[str]) -> int:
        """How many of the block `keys`, from the first, are stored and complete."""
        n = 0
        for key in keys:
            if key not in self._where:
                break
            n += 1
        return n

    def locate(self, keys: list[str]) -> list[tuple[str, int, list[tuple[int, int]]]]:
        """Where stored blocks are: [(file key, blocks in the file, [(position in the file, index into
        `keys`)])], files in the order of their first block. The keys come from a lookup in the same
        scheduler pass, so all are stored; one that is not (a bug) is sent as a one-block file of its own
        key, which the worker finds missing: a counted miss, recomputed, never a failed engine step."""
        files: dict[str, list[tuple[int, int]]] = {}
        for i, key in enumerate(keys):
            file, position = self._where.get(key, (key, 0))
            files.setdefault(file, []).append((position, i))
        return [(file, len(self._file_blocks.get(file, (file,))), slots) for file, slots in files.items()]

    def files_of(self, keys: list[str]) -> list[str]:
        """The files serving the stored ones of `keys`."""
        return list(dict.fromkeys(self._where[k][0] for k in keys if k in self._where))

    def loading_elsewhere(self, keys: list[str], req_id: str) -> bool:
        """True when another request's load is reading a file that serves one of the block `keys`: this
        one should wait and take those blocks from the engine's cache once that load is done, not read the
        same files again."""
        own = set(self._loads.get(req_id, ()))
        return any(self._pins.get(file) and file not in own for file in self.files_of(keys))

    # -- loads ------------------------------------------------------------------------------------------
    def prepare_load(self, req_id: str, files: list[str]) -> None:
        """Pin `files` for `req_id`'s load (never evicted until complete_load) and mark them recently used."""
        for key in files:
            self._pins[key] = self._pins.get(key, 0) + 1
            if key in self._present:
                self._present.move_to_end(key)
        self._loads.setdefault(req_id, []).extend(files)

    def complete_load(self, req_id: str) -> None:
        for key in self._loads.pop(req_id, ()):
            left = self._pins.get(key, 0) - 1
            if left > 0:
                self._pins[key] = left
                continue
            self._pins.pop(key, None)
            if key in self._present and not self._serving.get(key):  # superseded while it was read
                self._remove(key)
                self._deletes.append(key)

    def drop(self, key: str) -> None:
        """A file a worker found missing or damaged: out of the index with its blocks, its file removed."""
        if key in self._present:
            self._remove(key)
            self._deletes.append(key)

    # -- stores -----------------------------------------------------------------------------------------
    def prepare_store(self, key: str, blocks: list[str] | None = None) -> bool:
        """Announce a store of file `key` holding the block keys `blocks` (by default the one block `key`):
        False when it is stored or being stored already, when every one of its blocks is stored in other
        files, or when no room can be made without evicting a file a load is reading."""
        blocks = blocks or [key]
        if key in self._present or key in self._pending or all(b in self._where for b in blocks):
            return False
        size = self.chunk_bytes
        if size > self.capacity_bytes:
            self._decline(f"a chunk of {size} bytes exceeds the store capacity of {self.capacity_bytes}")
            return False
        if not self._make_room(size):
            self._decline("every stored chunk is being loaded; no room to evict")
            return False
        self._pending[key] = (size, blocks)
        self._used += size
        return True

    def complete_store(self, key: str, size: int, generation: int) -> None:
        if generation != self.generation:
            return
        pending = self._pending.pop(key, None)
        if pending is None:
            return
        reserved, blocks = pending
        self._used -= reserved
        self._add_file(key, size, blocks)
        self.chunk_bytes = max(self.chunk_bytes, size)
        # A file larger than announced may take the store over capacity: evict now, not at the next store.
        self._make_room(0)

    def fail_store(self, key: str, generation: int) -> None:
        if generation != self.generation:
            return
        pending = self._pending.pop(key, None)
        if pending is None:
            self.drop(key)  # another tensor-parallel rank wrote it, this one could not: not stored
        else:
            self._used -= pending[0]

    def _make_room(self, size: int) -> bool:
        if self.used_bytes + size <= self.capacity_bytes:
            return True
        free = self.capacity_bytes - self.used_bytes
        victims = []
        for key, old in self._present.items():  # least recently used first
            if free >= size:
                break
            if self._pins.get(key):
                continue
            victims.append(key)
            free += old
        if free < size:
            return False
        for key in victims:
            self._remove(key)
            self._deletes.append(key)
        self.counters.add("chunks_evicted", len(victims))
        return True

    def _decline(self, why: str) -> None:
        self.counters.add("writes_declined")
        if not self._declined_logged:
            self._declined_logged = True
            log.warning("kvoffload index: %s; saves are skipped (logged once)", why)

    # -- reset and the workers' part -------------------------------------------------------------------
    def reset(self) -> int:
        """Forget every chunk; the workers remove every file at their next step. Returns how many."""
        removed = len(self._present)
        for table in (self._present, self._file_blocks, self._where, self._serving, self._pending, self._deletes):
            table.clear()
        self._used = 0
        self._clear = True
        self.generation += 1
        return removed

    def take_deletions(self) -> tuple[bool, list[str]]:
        """(remove every file first, then these keys' files), for the next step's metadata."""
        clear, deletes = self._clear, self._deletes
        self._clear, self._deletes = False, []
        return clear, deletes

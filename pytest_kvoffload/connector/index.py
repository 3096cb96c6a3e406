"""The chunk index: which chunks the store holds, in LRU order; the one owner of what is stored and evicted.

It lives in the scheduler half, in the shape of vLLM's offloading manager (vllm/v1/kv_offload/base.py):
lookups read it, a load pins its chunks until the worker reports it done (so eviction under capacity
pressure never turns a promised hit into a recompute), a store is announced (room made, bytes reserved)
and completed when the worker reports the file in place, and eviction, damaged-chunk removal and reset
are decided here and sent to the workers as deletions. Workers only read, write and delete files.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from pathlib import Path

from pytest_kvoffload.connector.counters import Counters
from pytest_kvoffload.connector.store import SUFFIX

log = logging.getLogger("pytest_kvoffload.connector")


class ChunkIndex:
    def __init__(self, root: Path, capacity_bytes: int, chunk_bytes: int | None = None,
                 counters: Counters | None = None) -> None:
        self.capacity_bytes = capacity_bytes
        self.counters = counters or Counters()
        self._present: OrderedDict[str, int] = OrderedDict()  # key -> file bytes, least recently used first
        self._pending: dict[str, int] = {}  # key -> bytes reserved for a store not yet reported done
        # Bytes of both, kept as they change: summing 64k entries on every store would cost the scheduler.
        self._used = 0
        self._pins: dict[str, int] = {}  # key -> loads in flight reading it
        self._loads: dict[str, list[str]] = {}  # req_id -> the keys its load pinned
        self._deletes: list[str] = []  # files the workers remove at their next step
        self._clear = False
        self._declined_logged = False
        # Bumped by reset: a store announced before it reports into an index that no longer expects it.
        self.generation = 0
        self._scan(Path(root))
        # Size of one chunk file: the workers' reports are the truth; before one arrives, the files on disk
        # or the engine's KV geometry (connector.chunk_file_bytes) stand in.
        self.chunk_bytes = chunk_bytes or next(reversed(self._present.values()), 0)

    def _scan(self, root: Path) -> None:
        """What a previous server left on disk, oldest first: a restarted server still serves it."""
        entries = []
        try:
            with os.scandir(root) as it:
                for entry in it:
                    if entry.name.endswith(SUFFIX):
                        try:
                            st = entry.stat()
                        except OSError:
                            continue
                        entries.append((st.st_mtime, entry.name[:-len(SUFFIX)], st.st_size))
        except OSError:
            pass
        self._present = OrderedDict((key, size) for _, key, size in sorted(entries))
        self._used = sum(self._present.values())

    # -- reading the index ----------------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        return self._used

    def __contains__(self, key: str) -> bool:
        return key in self._present

    def __len__(self) -> int:
        return len(self._present)

    def lookup(self, keys: list[str]) -> int:
        """How many of `keys`, from the first, are stored and complete."""
        n = 0
        for key in keys:
            if key not in self._present:
                break
            n += 1
        return n

    def loading_elsewhere(self, keys: list[str], req_id: str) -> bool:
        """True when another request's load is reading one of `keys`: this one should wait and take those
        blocks from the engine's cache once that load is done, not read the same files again."""
        own = set(self._loads.get(req_id, ()))
        return any(self._pins.get(key) and key not in own for key in keys)

    # -- loads ------------------------------------------------------------------------------------------
    def prepare_load(self, req_id: str, keys: list[str]) -> None:
        """Pin `keys` for `req_id`'s load (never evicted until complete_load) and mark them recently used."""
        for key in keys:
            self._pins[key] = self._pins.get(key, 0) + 1
            if key in self._present:
                self._present.move_to_end(key)
        self._loads.setdefault(req_id, []).extend(keys)

    def complete_load(self, req_id: str) -> None:
        for key in self._loads.pop(req_id, ()):
            left = self._pins.get(key, 0) - 1
            if left > 0:
                self._pins[key] = left
            else:
                self._pins.pop(key, None)

    def drop(self, key: str) -> None:
        """A chunk a worker found missing or damaged: out of the index, its file removed."""
        size = self._present.pop(key, None)
        if size is not None:
            self._used -= size
            self._deletes.append(key)

    # -- stores -----------------------------------------------------------------------------------------
    def prepare_store(self, key: str) -> bool:
        """Announce a store of `key`: False when it is stored or being stored already, or when no room can
        be made without evicting a chunk a load is reading."""
        if key in self._present or key in self._pending:
            return False
        size = self.chunk_bytes
        if size > self.capacity_bytes:
            self._decline(f"a chunk of {size} bytes exceeds the store capacity of {self.capacity_bytes}")
            return False
        if not self._make_room(size):
            self._decline("every stored chunk is being loaded; no room to evict")
            return False
        self._pending[key] = size
        self._used += size
        return True

    def complete_store(self, key: str, size: int, generation: int) -> None:
        if generation != self.generation:
            return
        reserved = self._pending.pop(key, None)
        if reserved is None:
            return
        self._present[key] = size
        self._used += size - reserved
        self.chunk_bytes = size
        # A file larger than announced may take the store over capacity: evict now, not at the next store.
        self._make_room(0)

    def fail_store(self, key: str, generation: int) -> None:
        if generation != self.generation:
            return
        reserved = self._pending.pop(key, None)
        if reserved is None:
            self.drop(key)  # another tensor-parallel rank wrote it, this one could not: not stored
        else:
            self._used -= reserved

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
            self._used -= self._present.pop(key)
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
        self._present.clear()
        self._pending.clear()
        self._used = 0
        self._deletes.clear()
        self._clear = True
        self.generation += 1
        return removed

    def take_deletions(self) -> tuple[bool, list[str]]:
        """(remove every file first, then these keys' files), for the next step's metadata."""
        clear, deletes = self._clear, self._deletes
        self._clear, self._deletes = False, []
        return clear, deletes

"""The scheduler half: which stored blocks of a prompt to load, which finished chunks to save.

Runs in the engine-core process. Prefixes are matched block by block and saved a chunk (up to
`chunk_tokens`) at a time, a prompt's last chunk with the whole blocks it has. What is stored is the index's
(index.ChunkIndex) to say; the worker half moves the bytes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

from pytest_kvoffload.connector.config import ConnectorConfig
from pytest_kvoffload.connector.hashing import block_keys, request_key_root
from pytest_kvoffload.connector.index import ChunkIndex
from pytest_kvoffload.connector.metadata import ChunkBlocks, KVOffloadMetadata, LoadJob, ReadAheadJob, SaveJob

log = logging.getLogger("pytest_kvoffload.connector")


def opted_out(request) -> bool:
    """A request that asks to be neither saved nor loaded: "kv_transfer_params": {"kvoffload": "skip"} in
    its body (vLLM passes kv_transfer_params on to connectors). For one-off prompts that should not fill
    the store, and for measuring the engine's load without the connector's I/O (suites/test_disk_speed.py)."""
    params = getattr(request, "kv_transfer_params", None)
    return isinstance(params, dict) and params.get("kvoffload") == "skip"


@dataclass
class _Tracked:
    """A request the scheduler may save chunks of."""

    prompt: list[int]
    keys: list[str]  # of the prompt's whole blocks
    block_ids: list[int] = field(default_factory=list)
    next_chunk: int = 0
    computed: int = 0  # prompt tokens computed once the last scheduled step ends
    has_saves: bool = False


class Admit(Protocol):
    """The admission rule's call (admission.py): load the stored prefix, or recompute it."""

    def __call__(self, load_tokens: int, prompt_tokens: int, local_tokens: int, *,
                 ahead: list[tuple[int, int]], loading_tokens: int) -> bool: ...


class SchedulerSide:
    def __init__(self, config: ConnectorConfig, block_size: int, key_root: bytes, index: ChunkIndex,
                 admit: Admit | None = None, counters=None) -> None:
        self.config = config
        self.block_size = block_size
        self.chunk = config.chunk_tokens
        self.key_root = key_root
        self.index = index
        # admit(prefix tokens to load, prompt tokens, locally cached tokens, ahead=[(computed, prompt)] of
        # the running requests, loading_tokens=tokens of loads in flight) -> load or recompute.
        self.admit = admit
        self.counters = counters
        self._loading: dict[str, int] = {}  # req_id -> tokens being loaded
        self._decisions: dict[str, bool] = {}
        self._keys: dict[str, list[str]] = {}
        self._lookups: dict[str, int] = {}
        self._loads: list[LoadJob] = []
        self._tracked: dict[str, _Tracked] = {}
        # One load attempt per request: after a failed load vLLM asks again, and a damaged file that is
        # still there would otherwise be matched and fail forever.
        self._attempted: set[str] = set()
        self._deferred: set[str] = set()  # requests told to wait for another's load (counted once)
        self._read_aheads: list[ReadAheadJob] = []  # for the next step's metadata (on_new_request)
        self._staged: set[str] = set()  # requests read ahead whose staging no load has taken yet
        self._drops: list[str] = []

    def _keys_for(self, request) -> list[str]:
        """The request's block keys, made at its first lookup (vLLM looks every request up before it is
        scheduled); none for a request that cannot be keyed (hashing.request_key_root), which is then neither
        saved nor loaded."""
        keys = self._keys.get(request.request_id)
        if keys is None:
            root = request_key_root(self.key_root, request)
            if opted_out(request):
                keys = []
                if self.counters is not None:
                    self.counters.add("requests_opted_out")
            elif root is None:
                keys = []
                if self.counters is not None:
                    self.counters.add("requests_not_keyed")
            else:
                keys = block_keys(list(request.prompt_token_ids or []), self.block_size, root)
            self._keys[request.request_id] = keys
        return keys

    def _admitted(self, req_id: str, load: int, prompt: int, local: int) -> bool:
        # One decision per request: vLLM asks again when it could not schedule the request, and the
        # counters should count requests, not lookups.
        if req_id not in self._decisions:
            self._decisions[req_id] = self.admit(load, prompt, local, ahead=self._prefill_ahead(),
                                                 loading_tokens=sum(self._loading.values()))
        return self._decisions[req_id]

    def _prefill_ahead(self) -> list[tuple[int, int]]:
        return [(t.computed, len(t.prompt)) for t in self._tracked.values() if t.computed < len(t.prompt)]

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if request.request_id in self._attempted:
            return 0, False
        prompt = list(request.prompt_token_ids or [])
        keys = self._keys_for(request)
        matched = min(self.index.lookup(keys) * self.block_size, self._loadable(len(prompt)))
        if matched <= num_computed_tokens:
            return 0, False
        needed = keys[num_computed_tokens // self.block_size:matched // self.block_size]
        if self.index.loading_elsewhere(needed, request.request_id):
            # None: vLLM asks again next step, when those blocks are in its own cache.
            if self.counters is not None and request.request_id not in self._deferred:
                self._deferred.add(request.request_id)
                self.counters.add("lookups_deferred")
            return None, False
        if self.admit is not None and not self._admitted(request.request_id, matched - num_computed_tokens,
                                                         len(prompt), num_computed_tokens):
            return 0, False
        self._lookups[request.request_id] = num_computed_tokens
        return matched - num_computed_tokens, self.config.load_mode == "async"

    def on_new_request(self, request) -> None:
        """With read_ahead_mb: on arrival, a stored prefix the admission rule loads (it decides now, once) is
        read into the worker's staging memory while the request queues (read_ahead.py); its load takes it
        from there. Asynchronous loads only: a synchronous one reads in the step that computes the request."""
        if not self.config.read_ahead_bytes or self.config.load_mode != "async":
            return
        req_id, keys, prompt = request.request_id, self._keys_for(request), len(request.prompt_token_ids or [])
        matched = min(self.index.lookup(keys) * self.block_size, self._loadable(prompt))
        if matched <= 0 or (self.admit is not None and not self._admitted(req_id, matched, prompt, 0)):
            return
        files = self.index.locate(keys[:matched // self.block_size])
        self._read_aheads.append(ReadAheadJob(req_id, [(file, count) for file, count, _ in files], time.time()))
        self._staged.add(req_id)

    def _loadable(self, prompt_tokens: int) -> int:
        """Tokens a load may cover. The whole prompt where loads are asynchronous: once the load is in,
        vLLM takes the prompt as computed but for its last token, which it computes to sample from
        (Scheduler._update_waiting_for_remote_kv), so a fully stored prompt recomputes one token. A
        synchronous load must leave that token to the step itself: whole blocks short of it."""
        if self.config.load_mode == "async":
            return prompt_tokens
        return (prompt_tokens - 1) // self.block_size * self.block_size

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        req_id = request.request_id
        self._attempted.add(req_id)
        self._staged.discard(req_id)  # the worker frees what this load does not take
        if self.config.load_mode == "async":
            self._loading[req_id] = num_external_tokens  # until the worker reports it in finished_recving
        start = self._lookups.pop(req_id, 0)
        block_ids = blocks.get_block_ids()[0]
        first, end = start // self.block_size, (start + num_external_tokens) // self.block_size
        chunks = [ChunkBlocks(file, [(position, block_ids[first + i]) for position, i in slots], count)
                  for file, count, slots in self.index.locate(self._keys_for(request)[first:end])]
        self.index.prepare_load(req_id, [chunk.key for chunk in chunks])
        self._loads.append(LoadJob(req_id, chunks, sync=self.config.load_mode == "sync"))

    def build_connector_meta(self, scheduler_output) -> KVOffloadMetadata:
        meta = KVOffloadMetadata(loads=self._loads, read_aheads=self._read_aheads)
        self._loads, self._read_aheads = [], []
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id in self._staged and new.req_id not in self._attempted:
                self._drop_staged(new.req_id)  # computed without a load: its staging is not wanted
            prompt = list(new.prompt_token_ids or [])
            # Keys come from the request's lookup; one never looked up is not saved.
            tracked = _Tracked(prompt, self._keys.get(new.req_id, []), list(new.block_ids[0]))
            self._tracked[new.req_id] = tracked
            done = new.num_computed_tokens + scheduler_output.num_scheduled_tokens.get(new.req_id, 0)
            self._count_computed(tracked, new.num_computed_tokens, done)
            tracked.computed = done
            self._plan_saves(new.req_id, tracked, done, meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                tracked.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                tracked.block_ids.extend(new_ids[0])
            done = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            self._count_computed(tracked, cached.num_computed_tokens[i], done)
            tracked.computed = done
            self._plan_saves(req_id, tracked, done, meta)
        # Stores announced above may have evicted chunks: their deletions travel in this same step.
        meta.clear, meta.deletes = self.index.take_deletions()
        meta.idle = not any(scheduler_output.num_scheduled_tokens.values())
        meta.drops, self._drops = self._drops, []
        return meta

    def _drop_staged(self, req_id: str) -> None:
        self._staged.discard(req_id)
        self._drops.append(req_id)

    def _count_computed(self, tracked: _Tracked, before: int, after: int) -> None:
        """Prompt tokens the engine computes itself (kvoffload:prompt_tokens_computed): vLLM's own counters
        take a fully loaded prompt as all cached, though its last token is computed."""
        if self.counters is not None:
            n = len(tracked.prompt)
            self.counters.add("prompt_tokens_computed", max(0, min(after, n) - min(before, n)))

    def _plan_saves(self, req_id: str, tracked: _Tracked, computed: int, meta: KVOffloadMetadata) -> None:
        """Save each prompt chunk once a step has completed its blocks, whichever step that is: whole
        chunks, and the prompt's last chunk with the whole blocks it has (keyed by its last block)."""
        per_chunk = self.chunk // self.block_size
        done_blocks = min(computed, len(tracked.prompt)) // self.block_size
        while tracked.next_chunk * per_chunk < len(tracked.keys):
            c = tracked.next_chunk
            first, end = c * per_chunk, min((c + 1) * per_chunk, len(tracked.keys))
            blocks = tracked.block_ids[first:end]
            if done_blocks < end or len(blocks) < end - first:
                break
            tracked.next_chunk += 1
            keys = tracked.keys[first:end]
            if not self.index.prepare_store(keys[-1], keys):  # stored, being stored, or no room
                continue
            meta.saves.append(SaveJob(req_id, keys[-1], blocks, first, self.index.generation, keys))
            tracked.has_saves = True

    def request_finished(self, request, block_ids) -> tuple[bool, dict | None]:
        req_id = request.request_id
        self._keys.pop(req_id, None)
        self._lookups.pop(req_id, None)
        self._attempted.discard(req_id)
        self._loading.pop(req_id, None)
        self._decisions.pop(req_id, None)
        self._deferred.discard(req_id)
        if req_id in self._staged:  # finished or aborted before a load took its staging
            self._drop_staged(req_id)
        tracked = self._tracked.pop(req_id, None)
        # True keeps the blocks alive until the worker reports the saves done (get_finished).
        return bool(tracked and tracked.has_saves), None

    def update_connector_output(self, connector_output) -> None:
        for req_id in connector_output.finished_recving or ():
            self._loading.pop(req_id, None)
            self.index.complete_load(req_id)
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if meta is None:
            return
        for req_id in getattr(meta, "loaded", ()):
            self.index.complete_load(req_id)  # sync loads are not reported in finished_recving
        for key in getattr(meta, "dropped", ()):
            self.index.drop(key)
        for key, size, generation in getattr(meta, "stored", ()):
            self.index.complete_store(key, size, generation)
        # With tensor parallelism a chunk one rank failed to write is not stored, whichever rank reports
        # first and in whichever step (fail_store drops a chunk another rank completed).
        for key, _, generation in getattr(meta, "store_failed", ()):
            self.index.fail_store(key, generation)
        observe = getattr(self.admit, "observe", None)
        if observe is not None:
            for nbytes, seconds in getattr(meta, "loads", ()):
                observe(nbytes, seconds)

    def reset_cache(self) -> bool:
        removed = self.index.reset()
        log.info("kvoffload: store reset, %d chunks forgotten; the workers remove the files", removed)
        return True

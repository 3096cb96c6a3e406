"""kvoffload-disk on a real vLLM CPU server: exact outputs from disk, partial prefixes, restarts, faults."""

import shutil

import pytest

import time

from pytest_kvoffload.backends import kvoffload_store_dir
from pytest_kvoffload.client import measure
from pytest_kvoffload.connector.store import HEADER_SIZE, read_header
from pytest_kvoffload.prompts import expected_cached, make_prompt

pytestmark = [pytest.mark.server,
              pytest.mark.parametrize("kv_backend", ["kvoffload-disk"], indirect=True, scope="session")]

BLOCK, CHUNK, OUT = 128, 256, 8


@pytest.fixture
def store(kv_session, kv_backend, kv_server):
    return kvoffload_store_dir(kv_session.context(kv_backend)) / "rank0"


@pytest.fixture
def prompts(kv_session, request):
    def make(length, fraction, variant):
        return make_prompt(length, fraction, salt=f"{kv_session.salt}|{request.node.name}", variant=variant,
                           vocab_size=kv_session.settings.model.vocab_size)
    return make


def counter(result, name):
    return result.connector.get(f"kvoffload:{name}_total", 0)


@pytest.mark.parametrize("length,fraction", [(1000, 1.0), (2048, 0.5), (4500, 0.75)])
def test_disk_hit_gives_the_cold_output_and_loads_the_block_aligned_prefix(kv_server, prompts, length, fraction):
    # 4,500 tokens take three prefill steps on the CPU build: every chunk must still be saved.
    primer, target = prompts(length, fraction, "prime"), prompts(length, fraction, "measure")
    kv_server.reset_prefix_cache(external=True)
    cold = measure(kv_server, target.tokens, max_tokens=OUT)
    assert sum(cold.cached_by_source.values()) == 0
    kv_server.reset_prefix_cache(external=True)
    measure(kv_server, primer.tokens)
    kv_server.reset_prefix_cache(external=False)
    hit = measure(kv_server, target.tokens, max_tokens=OUT)
    assert hit.cached_by_source == {"disk": expected_cached(len(target.prefix), length, BLOCK, CHUNK)}
    assert hit.output_token_ids == cold.output_token_ids and len(cold.output_token_ids) == OUT
    assert counter(hit, "useful_bytes_read") > 0


def test_partial_match_loads_exactly_the_shared_chunks(kv_server, kv_settings, prompts, store):
    shared = prompts(2048, 0.6, "a")
    kv_server.reset_prefix_cache(external=True)
    measure(kv_server, shared.tokens)
    kv_server.reset_prefix_cache(external=False)
    other = prompts(2048, 0.6, "b")
    result = measure(kv_server, other.tokens)
    # 60% of 2,048 is 1,229 tokens: four whole 256-token chunks are shared, the fifth is not.
    assert result.cached_by_source == {"disk": 1024}
    assert counter(result, "chunks_read") == 4
    # KV bytes per token follow the dtype the machine computes in (4,096 in bf16, 8,192 in float32).
    assert counter(result, "useful_bytes_read") == 4 * CHUNK * kv_settings.kv_bytes_per_token


def total(endpoint, name):
    return endpoint.metrics().extra.get(f"kvoffload:{name}_total", 0)


def wait_for_total(endpoint, name, at_least, deadline_s=30):
    # Counters reach /metrics with the engine's next stats update, which can trail the request.
    end = time.monotonic() + deadline_s
    while total(endpoint, name) < at_least and time.monotonic() < end:
        time.sleep(0.2)
    return total(endpoint, name)


def test_reads_and_writes_move_only_useful_bytes_plus_one_header(kv_server, kv_settings, prompts):
    kv_server.reset_prefix_cache(external=True)
    written_before = total(kv_server, "useful_bytes_written")
    measure(kv_server, prompts(2048, 1.0, "x").tokens)
    kv_server.reset_prefix_cache(external=False)
    hit = measure(kv_server, prompts(2048, 1.0, "x").tokens)
    chunk_bytes = CHUNK * kv_settings.kv_bytes_per_token
    assert wait_for_total(kv_server, "useful_bytes_written", written_before + 8 * chunk_bytes) \
        == written_before + 8 * chunk_bytes
    # Read amplification: exactly one 4 KiB header per chunk, nothing copied twice.
    assert counter(hit, "bytes_read") == counter(hit, "useful_bytes_read") + counter(hit, "chunks_read") * HEADER_SIZE


def chunk_file(store, index, newer_than):
    for path in store.glob("*.kv"):
        if path.stat().st_mtime >= newer_than and read_header(path)["chunk_index"] == index:
            return path
    raise AssertionError(f"no chunk {index} in {store}")


def _damage(path, how):
    data = bytearray(path.read_bytes())
    if how == "corrupt":
        data[8192] ^= 0xFF
    elif how == "truncated":
        data = data[:len(data) // 3]
    elif how == "foreign":
        data[12:44] = bytes(32)  # the header's model fingerprint
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("fault,count", [("corrupt", "chunks_corrupt"), ("truncated", "chunks_corrupt"),
                                         ("foreign", "chunks_foreign"), ("missing", None)])
def test_damaged_store_files_become_misses_with_cold_output(kv_server, prompts, store, fault, count):
    prompt = prompts(1024, 1.0, "p")
    kv_server.reset_prefix_cache(external=True)
    started = time.time() - 1
    cold = measure(kv_server, prompt.tokens, max_tokens=OUT)
    kv_server.reset_prefix_cache(external=False)
    assert len(list(store.glob("*.kv"))) == 4
    second = chunk_file(store, 1, started)
    if fault == "missing":
        second.unlink()
    else:
        _damage(second, fault)
    result = measure(kv_server, prompt.tokens, max_tokens=OUT)
    assert result.output_token_ids == cold.output_token_ids
    disk = result.cached_by_source.get("disk", 0)
    if count:
        assert counter(result, count) == 1
        assert counter(result, "blocks_load_failed") >= 2
    else:
        assert disk == CHUNK  # the lookup stops at the hole
    assert result.cached_by_source.get("device", 0) == 0


def test_vanished_store_folder_declines_saves_and_serves(kv_server, prompts, store):
    prompt = prompts(1024, 1.0, "v")
    kv_server.reset_prefix_cache(external=True)
    shutil.rmtree(store)
    try:
        first = measure(kv_server, prompt.tokens, max_tokens=OUT)
        kv_server.reset_prefix_cache(external=False)
        second = measure(kv_server, prompt.tokens, max_tokens=OUT)
        assert second.output_token_ids == first.output_token_ids
        assert sum(second.cached_by_source.values()) == 0
        assert counter(first, "write_errors_vanished") + counter(second, "write_errors_vanished") >= 1
        assert not store.exists()
    finally:
        store.mkdir(parents=True, exist_ok=True)


def test_a_restarted_server_serves_disk_hits_from_the_same_store(kv_session, kv_backend, kv_server, prompts):
    prompt = prompts(1024, 1.0, "r")
    kv_server.reset_prefix_cache(external=True)
    cold = measure(kv_server, prompt.tokens, max_tokens=OUT)
    kv_session.pool.release(kv_backend.name)
    restarted = kv_session.endpoint(kv_backend)
    assert restarted.port != kv_server.port
    hit = measure(restarted, prompt.tokens, max_tokens=OUT)
    assert hit.cached_by_source == {"disk": 896}
    assert hit.output_token_ids == cold.output_token_ids

"""kvoffload-disk on a real vLLM CPU server: exact outputs from disk, partial prefixes, restarts, faults."""

import shutil

import pytest

import time

from pytest_kvoffload.serve.builtin.kvoffload_disk import kvoffload_store_dir
from pytest_kvoffload.serve.client import measure, stream_completion
from pytest_kvoffload.measure.output_check import compare_outputs
from pytest_kvoffload.measure.runner import recompute
from pytest_kvoffload.connector.counters import HISTOGRAMS
from pytest_kvoffload.connector.chunk_format import HEADER_SIZE, read_header
from pytest_kvoffload.serve.metrics import histograms
from pytest_kvoffload.measure.prompts import expected_cached, make_prompt

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


def cold_answer(endpoint, tokens, tag):
    return recompute(endpoint, tokens, f"cold|{tag}|{time.time()}")


def assert_same_answer(hit, cold):
    # Equal greedy tokens, up to a near-tie in the recompute's logprobs (measure/output_check.py).
    difference = compare_outputs(hit, cold).difference
    margins = [sorted(top.values(), reverse=True)[:3] for top in cold.top_logprobs]
    assert difference is None and len(cold.output_token_ids) == OUT, f"{difference}; recompute's top logprobs {margins}"


def counter(result, name):
    return result.connector.get(f"kvoffload:{name}_total", 0)


@pytest.mark.parametrize("length,fraction", [(1000, 1.0), (2048, 0.5), (4500, 0.75)])
def test_disk_hit_gives_the_cold_output_and_loads_the_block_aligned_prefix(kv_server, prompts, length, fraction):
    # 4,500 tokens take three prefill steps on the CPU build: every chunk must still be saved.
    primer, target = prompts(length, fraction, "prime"), prompts(length, fraction, "measure")
    kv_server.reset_prefix_cache(external=True)
    cold = cold_answer(kv_server, target.tokens, "disk-hit")
    measure(kv_server, primer.tokens)
    kv_server.reset_prefix_cache(external=False)
    hit = measure(kv_server, target.tokens, max_tokens=OUT)
    # Every whole block of the prefix, the prompt's last block too where the prefix covers it.
    assert hit.cached_by_source == {"disk": expected_cached(len(target.prefix), length, BLOCK, last_block=True)}
    assert_same_answer(hit, cold)
    assert counter(hit, "useful_bytes_read") > 0


@pytest.mark.parametrize("last_block_differs", [False, True], ids=["whole-prompt", "control-last-block-differs"])
def test_a_fully_stored_prompt_recomputes_exactly_one_token(kv_server, kv_settings, prompts, last_block_differs):
    prompt = prompts(1024, 1.0, f"whole-{last_block_differs}")
    kv_server.reset_prefix_cache(external=True)
    measure(kv_server, prompt.tokens)
    kv_server.reset_prefix_cache(external=False)
    # The control: the same prompt with another last block matches seven blocks, and vLLM's counter of
    # computed tokens then reads a whole block, so "one token" below is a measurement, not a constant.
    tokens = prompt.tokens[:-BLOCK] + prompts(BLOCK, 0.0, "other-tail").tokens if last_block_differs \
        else prompt.tokens
    before = total(kv_server, "prompt_tokens_computed")
    hit = measure(kv_server, tokens, max_tokens=OUT)
    # The connector's count of prompt tokens the engine computed (vLLM's own counters take a loaded
    # prompt as all cached); it reaches /metrics with the engine's next stats update.
    computed = wait_for_total(kv_server, "prompt_tokens_computed", before + 1) - before
    if last_block_differs:
        assert hit.cached_by_source == {"disk": 1024 - BLOCK} and computed == BLOCK
        return
    assert hit.cached_by_source == {"disk": 1024} and hit.cached_tokens in (None, 1024)
    assert computed == 1
    assert counter(hit, "useful_bytes_read") == 1024 * kv_settings.kv_bytes_per_token
    assert_same_answer(hit, cold_answer(kv_server, tokens, "whole"))


def test_a_prefix_ending_mid_chunk_loads_every_whole_block_it_covers(kv_server, kv_settings, prompts, store):
    shared = prompts(2048, 0.6, "a")
    kv_server.reset_prefix_cache(external=True)
    measure(kv_server, shared.tokens)
    kv_server.reset_prefix_cache(external=False)
    other = prompts(2048, 0.6, "b")
    result = measure(kv_server, other.tokens, max_tokens=OUT)
    # 60% of 2,048 is 1,229 tokens: nine whole 128-token blocks, four whole 256-token chunks and the
    # first block of the fifth chunk's file (read whole for its checksum, one block of it used).
    assert result.cached_by_source == {"disk": 9 * BLOCK}
    assert counter(result, "chunks_read") == 5
    # KV bytes per token follow the dtype the machine computes in (4,096 in bf16, 8,192 in float32).
    assert counter(result, "useful_bytes_read") == 9 * BLOCK * kv_settings.kv_bytes_per_token
    assert_same_answer(result, cold_answer(kv_server, other.tokens, "mid-chunk"))


def total(endpoint, name):
    return endpoint.metrics().extra.get(f"kvoffload:{name}_total", 0)


def wait_for_total(endpoint, name, at_least, deadline_s=30):
    # Counters reach /metrics with the engine's next stats update, which can trail the request.
    end = time.monotonic() + deadline_s
    while total(endpoint, name) < at_least and time.monotonic() < end:
        time.sleep(0.2)
    return total(endpoint, name)


# Every histogram but the read-ahead's: read_ahead_mb is off on this server (tests/connector/test_read_ahead.py).
OBSERVED = [name for name in HISTOGRAMS if not name.startswith("read_ahead_")]


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
    # Each load and each step's saves are also observed in histograms beside the totals.
    end = time.monotonic() + 30
    while time.monotonic() < end:
        found = histograms(kv_server.metrics_text())
        if all(found.get(f"kvoffload:{name}", {}).get("count") for name in OBSERVED):
            break
        time.sleep(0.2)
    for name in OBSERVED:
        assert found.get(f"kvoffload:{name}", {}).get("count", 0) >= 1, f"no {name} observed"
    assert found["kvoffload:load_size_bytes"]["sum"] >= 8 * chunk_bytes  # bytes, not chunks: this hit alone read 8


def chunk_file(store, index, newer_than):
    for path in store.glob("*.kv"):
        if path.stat().st_mtime >= newer_than and read_header(path)["first_block"] == index * CHUNK // BLOCK:
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
                                         ("foreign", "chunks_foreign"), ("missing", "chunks_missing")])
def test_damaged_store_files_become_misses_with_cold_output(kv_server, prompts, store, fault, count):
    prompt = prompts(1024, 1.0, "p")
    kv_server.reset_prefix_cache(external=True)
    started = time.time() - 1
    measure(kv_server, prompt.tokens)  # writes the chunks
    kv_server.reset_prefix_cache(external=False)
    assert len(list(store.glob("*.kv"))) == 4
    second = chunk_file(store, 1, started)
    if fault == "missing":
        second.unlink()
    else:
        _damage(second, fault)
    result = measure(kv_server, prompt.tokens, max_tokens=OUT)
    cold = cold_answer(kv_server, prompt.tokens, f"damaged-{fault}")
    assert_same_answer(result, cold)
    # The index still listed the file removed behind its back ("missing"): every fault is a failed load.
    assert counter(result, count) == 1
    assert counter(result, "blocks_load_failed") >= 2
    assert result.cached_by_source.get("device", 0) == 0
    # The index forgot the bad chunk and had its file removed; the recompute saved it afresh (or, had the
    # report come after the save was planned, the next lookup stops at the hole): no fault a second time.
    kv_server.reset_prefix_cache(external=False)
    again = measure(kv_server, prompt.tokens, max_tokens=OUT)
    assert again.cached_by_source.get("disk", 0) in (CHUNK, 1024) and counter(again, count) == 0
    assert_same_answer(again, cold)


def test_a_vanished_store_folder_is_recreated_and_serves_again(kv_server, prompts, store):
    prompt = prompts(1024, 1.0, "v")
    kv_server.reset_prefix_cache(external=True)
    recreated = total(kv_server, "store_recreated")
    shutil.rmtree(store)  # a cleanup job, an operator
    measure(kv_server, prompt.tokens)
    kv_server.reset_prefix_cache(external=False)
    second = measure(kv_server, prompt.tokens, max_tokens=OUT)
    # Counters reach /metrics with the engine's stats, possibly after the request: wait for the total.
    assert wait_for_total(kv_server, "store_recreated", recreated + 1) == recreated + 1
    assert second.cached_by_source == {"disk": 1024}
    assert_same_answer(second, cold_answer(kv_server, prompt.tokens, "vanished"))
    assert store.is_dir()


@pytest.mark.kv_servers("{backend}~b")
def test_a_second_server_serves_disk_hits_from_the_store_the_first_wrote(kv_session, kv_server, store_twin,
                                                                        prompts):
    prompt = prompts(1024, 1.0, "r")
    kv_server.reset_prefix_cache(external=True)
    measure(kv_server, prompt.tokens)  # writes the chunks
    second = kv_session.endpoint(store_twin)  # a fresh process: it knows the chunks from their headers only
    assert second.port != kv_server.port
    hit = measure(second, prompt.tokens, max_tokens=OUT)
    assert hit.cached_by_source == {"disk": 1024}
    assert_same_answer(hit, cold_answer(second, prompt.tokens, "second"))


def test_a_tier_load_on_top_of_a_partial_engine_hit(kv_server, prompts):
    # The first 512 tokens stay in the engine's cache, the next ones come from disk: the load starts
    # at a block inside the prompt (update_state_after_alloc with start > 0).
    full = prompts(2048, 1.0, "full")
    kv_server.reset_prefix_cache(external=True)
    measure(kv_server, full.tokens)                      # every chunk on disk
    kv_server.reset_prefix_cache(external=False)
    measure(kv_server, full.tokens[:600])                # the first 512 tokens back in the engine only
    hit = measure(kv_server, full.tokens, max_tokens=OUT)
    assert hit.cached_by_source.get("device") == 512 and hit.cached_by_source.get("disk") == 2048 - 512
    assert_same_answer(hit, cold_answer(kv_server, full.tokens, "partial"))


def test_a_prefix_ending_inside_a_block_and_inside_a_chunk(kv_server, prompts):
    # 700 shared tokens: two whole chunks (512), then 188 tokens of a third chunk, ending mid-block: the
    # third chunk's first block (640 in all) is loaded, the block the prefix ends in is not.
    shared = prompts(1400, 0.5, "a")
    kv_server.reset_prefix_cache(external=True)
    measure(kv_server, shared.tokens)
    kv_server.reset_prefix_cache(external=False)
    other = prompts(1400, 0.5, "b")
    hit = measure(kv_server, other.tokens, max_tokens=OUT)
    assert hit.cached_by_source == {"disk": 640}
    assert_same_answer(hit, cold_answer(kv_server, other.tokens, "inside"))


def test_two_concurrent_requests_sharing_a_prefix_while_it_loads(kv_server, kv_settings, prompts):
    from concurrent.futures import ThreadPoolExecutor

    from pytest_kvoffload.serve.client import Endpoint

    first, second = prompts(2048, 0.75, "one"), prompts(2048, 0.75, "two")
    kv_server.reset_prefix_cache(external=True)
    measure(kv_server, prompts(2048, 0.75, "primer").tokens)
    kv_server.reset_prefix_cache(external=False)
    read_before = wait_for_total(kv_server, "chunks_read", 0)
    other = Endpoint(kv_server.url, kv_server.model_name)  # one HTTP session per thread
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(stream_completion, other, second.tokens, OUT)
        a = stream_completion(kv_server, first.tokens, OUT)
        b = pending.result()
    # 75% of 2,048 tokens: six whole chunks shared with the primer. Whichever request looks up second
    # waits for the first's load and takes those blocks from the engine: each chunk is read once.
    wait_for_total(kv_server, "chunks_read", read_before + 6, deadline_s=10)
    time.sleep(1.0)  # a second read of the same chunks would reach /metrics within this
    assert total(kv_server, "chunks_read") == read_before + 6
    assert_same_answer(a, cold_answer(kv_server, first.tokens, "one"))
    assert_same_answer(b, cold_answer(kv_server, second.tokens, "two"))


def test_a_request_that_opts_out_neither_writes_nor_reads_the_store(kv_server, prompts):
    from pytest_kvoffload.drive.engine_load import OPT_OUT

    tokens = prompts(1024, 1.0, "opt-out").tokens
    written, opted = total(kv_server, "chunks_written"), total(kv_server, "requests_opted_out")
    stream_completion(kv_server, tokens, kv_transfer_params=OPT_OUT)
    assert wait_for_total(kv_server, "requests_opted_out", opted + 1) == opted + 1
    kv_server.reset_prefix_cache(external=False)
    again = measure(kv_server, tokens)  # not opted out: a miss (nothing was saved), and this one is saved
    assert sum(again.cached_by_source.values()) == 0, again.cached_by_source
    # The control: the same prompt without the opt-out writes its 4 chunks.
    assert wait_for_total(kv_server, "chunks_written", written + 4) == written + 4

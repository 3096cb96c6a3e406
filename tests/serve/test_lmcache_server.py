"""lmcache-disk on a real vLLM CPU server beside LMCache's multiprocess server (the suites' shared one):
a tier hit is a read of LMCache's files, a vanished file is a recompute with the right output, and a killed
LMCache server fails the backend with its log tail and leaves no process or shared memory behind."""

import os
import signal

import pytest

from pytest_kvoffload.measure.prompts import make_prompt
from pytest_kvoffload.measure.output_check import compare_outputs
from pytest_kvoffload.measure.runner import recompute
from pytest_kvoffload.serve.builtin import lmcache_disk as lmcache
from pytest_kvoffload.serve.client import attach_sources, measure, stream_completion
from pytest_kvoffload.serve.processes import group_has_live_members, shared_memory_files
from pytest_kvoffload.serve.server import ServerStartError

pytestmark = [pytest.mark.server,
              pytest.mark.parametrize("kv_backend", ["lmcache-disk"], indirect=True, scope="session")]

LENGTH = 1024  # four whole chunks of 256: LMCache holds the whole prompt


def prompt(kv_session, name):
    return make_prompt(LENGTH, 1.0, salt=f"{kv_session.salt}|lmcache|{name}",
                       vocab_size=kv_session.settings.model.vocab_size).tokens


def l2_files(kv_session):
    return sorted(lmcache.l2_folder(kv_session.context(kv_session.registry.get(lmcache.NAME)).scratch).iterdir())


def test_a_tier_hit_reads_every_chunk_from_lmcache_files(kv_session, kv_server):
    tokens = prompt(kv_session, "tier")
    measure(kv_server, tokens)
    engine = measure(kv_server, tokens)
    # The engine's cache serves all but the last block; LMCache serves that block, and reads every chunk
    # of the prompt from its files to do it (its prefetch loads what the lookup found).
    assert engine.cached_by_source == {"device": LENGTH - 128, "external_unspecified": 127}
    assert engine.connector[lmcache.L2_LOADED_CHUNKS] == LENGTH // lmcache.CHUNK_TOKENS
    kv_server.reset_prefix_cache(external=False)
    hit = measure(kv_server, tokens)
    assert hit.cached_by_source == {"external_unspecified": LENGTH - 1}
    assert hit.connector[lmcache.L2_LOADED_CHUNKS] == LENGTH // lmcache.CHUNK_TOKENS
    assert lmcache.load_proof(hit.connector, LENGTH - 1, kv_session.settings.kv_bytes_per_token) is None


def test_vanished_lmcache_files_are_a_counted_miss_with_the_right_output(kv_session,
                                                                                              kv_server):
    tokens = prompt(kv_session, "vanished")
    before = set(l2_files(kv_session))
    measure(kv_server, tokens)
    new = set(l2_files(kv_session)) - before
    assert len(new) == LENGTH // lmcache.CHUNK_TOKENS
    for path in new:
        path.unlink()
    kv_server.reset_prefix_cache(external=False)
    before_hit = kv_server.metrics()
    result = stream_completion(kv_server, tokens, 8)
    attach_sources(kv_server, before_hit, result)
    # LMCache's lookup checks its files: a counted miss (its lookup found nothing), nothing loaded.
    assert result.cached_by_source == {} and not result.connector.get("lmcache_mp_lookup_hit_tokens_total")
    assert lmcache.load_proof(result.connector, LENGTH - 1, kv_session.settings.kv_bytes_per_token) is not None
    reference = recompute(kv_server, tokens, f"{kv_session.salt}|lmcache|vanished|recompute")
    assert compare_outputs(result, reference).matches


@pytest.mark.kv_kills_server
def test_a_killed_lmcache_server_fails_the_backend_with_its_log_tail_and_leaves_nothing(kv_session, kv_backend,
                                                                                       kv_server):
    companion = kv_server.companion
    groups = (kv_server.pgid, companion.proc.pid)
    shared = shared_memory_files(groups[0]) | shared_memory_files(groups[1])
    assert any("lmcache" in path for path in shared), shared  # the engine's KV, shared with LMCache's server
    os.killpg(companion.proc.pid, signal.SIGKILL)
    companion.proc.wait(timeout=30)
    with pytest.raises(ServerStartError) as failed:
        kv_session.endpoint(kv_backend)
    message = str(failed.value)
    assert "LMCache's server exited with code -9 during the session" in message
    assert str(companion.log_path) in message and "LMCache" in message.split("last lines:", 1)[1]
    assert not any(group_has_live_members(pgid) for pgid in groups)
    assert not [path for path in shared if os.path.exists(path)]
    # Every later test of the backend fails the same way, without a new start.
    with pytest.raises(ServerStartError, match="LMCache's server exited"):
        kv_session.endpoint(kv_backend)

"""Eviction through the index on a real server: opt-in, as it needs a kvoffload-disk server with a store
of about 10 MB (a variant server would add a start-up to every `make test`; the index's logic is tested
in test_index.py):

    pytest tests/connector/test_eviction_server.py --kv-backend=kvoffload-disk --kv-disk-opt capacity_gb=0.01
"""

import time

import pytest

from pytest_kvoffload.serve.builtin.kvoffload_disk import kvoffload_store_dir
from pytest_kvoffload.serve.client import measure
from pytest_kvoffload.measure.prompts import make_prompt

pytestmark = [pytest.mark.server,
              pytest.mark.parametrize("kv_backend", ["kvoffload-disk"], indirect=True, scope="session")]


def test_eviction_keeps_the_store_under_capacity_and_serves_the_newest(kv_session, kv_settings, kv_backend):
    capacity_gb = float(kv_settings.disk_opts.get("capacity_gb", 64))
    if capacity_gb > 0.02:
        pytest.skip("opt-in: run with --kv-disk-opt capacity_gb=0.01 (a store of a few chunks)")
    kv_server = kv_session.endpoint(kv_backend)
    store = kvoffload_store_dir(kv_session.context(kv_backend)) / "rank0"
    prompts = [make_prompt(1025, 1.0, salt=f"{kv_session.salt}|evict|{i}", vocab_size=kv_settings.model.vocab_size).tokens
               for i in range(4)]
    kv_server.reset_prefix_cache(external=True)
    sizes = []
    for tokens in prompts:
        measure(kv_server, tokens)
        time.sleep(0.5)  # the last step's saves land
        sizes.append(sum(p.stat().st_size for p in store.glob("*.kv")))
    kv_server.reset_prefix_cache(external=False)
    newest = measure(kv_server, prompts[-1])
    kv_server.reset_prefix_cache(external=False)
    oldest = measure(kv_server, prompts[0])
    print(f"store bytes after each prompt {sizes}; newest {newest.cached_by_source}, oldest {oldest.cached_by_source}")
    assert max(sizes) <= capacity_gb * 1e9
    assert newest.cached_by_source == {"disk": 1024}
    assert oldest.cached_by_source.get("disk", 0) == 0  # evicted first, least recently used

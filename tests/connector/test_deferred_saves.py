"""The CPU build's saves wait for the next step's bind (connector.KVOffloadDiskConnector.wait_for_save): vLLM
calls wait_for_save before the step samples, so a chunk gathered there would delay the step's tokens. They are
submitted at the next bind, before that step's deletions and loads; where new blocks are zeroed during a step
(Mamba, mixed precision) they are submitted at once, as before."""

import time

import torch

from test_index import BLOCK, CHUNK

from pytest_kvoffload.connector.config import ConnectorConfig
from pytest_kvoffload.connector.connector import KVOffloadDiskConnector
from pytest_kvoffload.connector.metadata import KVOffloadMetadata, SaveJob
from pytest_kvoffload.connector.worker import WorkerSide

KEY = f"{7:032x}"


def cpu_connector(tmp_path, zeroes_blocks=False):
    """The connector's worker role around a real WorkerSide on a CPU cache; vLLM's config is not needed here."""
    config = ConnectorConfig.from_extra({"store_dir": str(tmp_path), "chunk_tokens": CHUNK, "io_threads": 2}, BLOCK)
    side = WorkerSide(config, "model=test", tmp_path / "rank0", BLOCK)
    side.register_kv_caches({f"layer{i}": torch.randn(8, 2, BLOCK, 2, 8) for i in range(2)})
    connector = object.__new__(KVOffloadDiskConnector)
    connector._worker, connector._zeroes_blocks, connector._deferred_saves = side, zeroes_blocks, []
    return connector, side


def step(connector, meta, finished=frozenset()):
    """One engine step as vLLM drives the worker role: bind, (forward,) wait_for_save, get_finished, clear."""
    connector.bind_connector_metadata(meta)
    connector.wait_for_save()
    sent, _ = connector.get_finished(set(finished))
    connector.clear_connector_metadata()
    return sent


def settle(connector, req_id):
    deadline = time.time() + 30
    while not step(connector, KVOffloadMetadata(idle=True), {req_id}):
        assert time.time() < deadline, "the saves never finished"
        time.sleep(0.01)


def test_a_steps_saves_are_written_after_the_next_bind_not_before_its_tokens(tmp_path):
    connector, side = cpu_connector(tmp_path)
    step(connector, KVOffloadMetadata(saves=[SaveJob("q", KEY, [2, 3], 0)]))
    time.sleep(0.2)  # long enough for a submitted chunk's write
    # Neither gathered (on the step's thread, save_copy_seconds) nor written.
    assert not side.store.path(KEY).exists() and "save_copy_seconds" not in side.counters.drain()
    settle(connector, "q")  # the next step's bind submits it; the request is reported once it is written
    assert side.store.path(KEY).exists()
    side.shutdown()


def test_where_blocks_are_zeroed_during_a_step_saves_are_submitted_at_once(tmp_path):
    connector, side = cpu_connector(tmp_path, zeroes_blocks=True)
    step(connector, KVOffloadMetadata(saves=[SaveJob("q", KEY, [2, 3], 0)]))
    assert side.counters.drain().get("save_copy_seconds", 0) > 0  # gathered in the step that computed it
    side.shutdown()


def test_a_reset_in_the_next_step_removes_the_chunks_the_step_before_saved(tmp_path):
    # As when they were submitted in their own step: the reset waits for their writes, then removes them.
    connector, side = cpu_connector(tmp_path)
    step(connector, KVOffloadMetadata(saves=[SaveJob("q", KEY, [2, 3], 0)]))
    step(connector, KVOffloadMetadata(clear=True, idle=True))
    settle(connector, "q")
    assert not side.store.path(KEY).exists()
    side.shutdown()

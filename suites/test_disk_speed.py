"""The disk tier against the raw drive, side by side in one run on the same drive: figures printed (no timed
asserts), the sources of every hit asserted. What is measured and how to read it: suite_machinery/disk_speed.py."""

import pytest

from pytest_kvoffload.suite_machinery.disk_speed import DiskSpeed
from pytest_kvoffload.record.disk_speed_summary import DISK_SPEED
from pytest_kvoffload.serve.builtin.kvoffload_disk import kvoffload_chunk_tokens, kvoffload_store_dir

pytestmark = pytest.mark.parametrize("kv_backend", ["kvoffload-disk"], indirect=True, scope="session")


def test_disk_tier_against_the_raw_drive(kv_session, kv_backend, kv_server, kv_settings):
    if kv_backend.name not in kv_settings.backends:
        pytest.skip(f"{kv_backend.name} is not among --kv-backend")
    speed = DiskSpeed(kv_server, kvoffload_store_dir(kv_session.context(kv_backend)), kv_settings,
                      tuple(kv_session.lengths), kvoffload_chunk_tokens(kv_settings), kv_session.salt,
                      kv_session.progress).run()
    kv_session.add_benchmark(DISK_SPEED, speed.text, speed.figures)
    assert not speed.problems, "; ".join(speed.problems)
    counters = speed.figures["counters"]
    assert counters["useful_bytes_read"] > 0 and counters["useful_bytes_written"] > 0

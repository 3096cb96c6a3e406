"""The disk tier against the raw drive, side by side in one run on the same drive.

Prints figures (no timed asserts): the connector's delivered read and write bandwidth as a share of
the drive's O_DIRECT probe at the connector's chunk size, bytes moved per useful KV byte, and disk-hit
TTFT against device-hit and cold TTFT at each length. Correctness is still asserted: every hit must
come from the source it is meant to come from.

The drive is probed before and after the connector's rounds (a virtual disk drifts: the ratio is taken
against their mean and their difference is printed), and the store alone (probe_store: chunk files
written and read by ChunkStore, no engine) is measured after them, so that the gap to the drive splits
into what the file format costs and what sharing the machine with the engine costs. Where the engine binds
its worker to some cores (vLLM's CPU build: the connector's I/O threads inherit that binding) the store
alone is measured on those cores too, and the CPU time the server's processes take during the rounds is
printed beside the figures (drive/cpu_use.py).

Writes are held to the drive's figure for the writes the connector made: the probe writes a fresh file
and then over it, and the connector's chunks written over recycled files (store.py) count against the
second (twice the first on the 2-core VM). The scheduler's per-chunk times of the connector's I/O threads
are printed beside those of the store alone.

The connector's own pattern is bursts: a step's chunks written at once, a prompt's chunks read at once,
then nothing. The drive alone in that pattern (probe_disk_bursts: raw requests, none of our code) is the
reference the targets are held to, and the gap to the continuous probe splits in three: what the pattern
costs on the drive (drive in bursts / continuous probe), what the connector's code costs (its save and
load paths alone in the pattern, no engine: drive/worker_probe.py, against the drive in it) and what the engine
beside it costs (the connector in the server against its code alone).
"""

import pytest

from pytest_kvoffload.drive.disk_speed import DiskSpeed
from pytest_kvoffload.serve.builtin_backends import kvoffload_store_dir

pytestmark = pytest.mark.parametrize("kv_backend", ["kvoffload-disk"], indirect=True, scope="session")


def test_disk_tier_against_the_raw_drive(kv_session, kv_backend, kv_server, kv_settings):
    if kv_backend.name not in kv_settings.backends:
        pytest.skip(f"{kv_backend.name} is not among --kv-backend")
    speed = DiskSpeed(kv_server, kvoffload_store_dir(kv_session.context(kv_backend)), kv_settings,
                      tuple(kv_session.lengths), kv_backend.granularity(kv_settings), kv_session.salt,
                      kv_session.progress).run()
    kv_session.add_benchmark("kvoffload-disk speed", speed.text, speed.figures)
    assert not speed.problems, "; ".join(speed.problems)
    counters = speed.figures["counters"]
    assert counters["useful_bytes_read"] > 0 and counters["useful_bytes_written"] > 0

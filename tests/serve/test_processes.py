"""Waiting for servers to stop computing (serve/processes.wait_until_quiet), on stand-in process groups."""

import subprocess
import sys
import time

from pytest_kvoffload.serve.processes import wait_until_quiet

SPIN_THEN_SLEEP = """
import sys, time
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    pass
time.sleep(60)
"""


def group(seconds_spinning):
    return subprocess.Popen([sys.executable, "-c", SPIN_THEN_SLEEP, str(seconds_spinning)], start_new_session=True)


def test_the_wait_ends_when_the_group_stops_spinning_and_not_before():
    spinner = group(0.6)
    try:
        time.sleep(0.1)
        waited = wait_until_quiet([spinner.pid], limit_s=5.0)
        assert 0.4 <= waited < 2.0, waited
    finally:
        spinner.kill()
    # The control: a group that spins throughout is never quiet, and the wait stops at its limit.
    forever = group(60)
    try:
        time.sleep(0.1)
        assert wait_until_quiet([forever.pid], limit_s=0.8) >= 0.8
    finally:
        forever.kill()
    # A group already asleep costs two windows.
    asleep = group(0)
    try:
        time.sleep(0.3)
        assert wait_until_quiet([asleep.pid], limit_s=5.0) < 0.5
    finally:
        asleep.kill()

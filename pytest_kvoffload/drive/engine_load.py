"""Give a server's engine the work a suite gives it, with no KV moving through the connector.

To tell what the machine leaves a drive writer while vLLM computes from what the connector's own code
costs, the suites run the connector's store alone beside the engine doing the same work as in their
rounds: fresh prompts of the same lengths, one after another. Each request opts out of the kvoffload
connector (kv_transfer_params {"kvoffload": "skip"}: neither saved nor loaded); the caller checks that
the connector's chunk counters did not move and that requests_opted_out did.

The client runs in a process of its own: as a thread beside the store's I/O threads it would hold the
measuring process's GIL (parsing the stream) and the store would measure the interpreter.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid

from pytest_kvoffload.serve.client import Endpoint, RequestError, stream_completion
from pytest_kvoffload.measure.prompts import make_prompt

OPT_OUT = {"kvoffload": "skip"}


class EngineLoad:
    """A context manager: fresh prompts of `lengths` tokens in turn, back to back, for at most `max_s`
    seconds (a cap, so that a measurement starved by the load still ends: `capped` says so)."""

    def __init__(self, endpoint: Endpoint, lengths: list[int], vocab_size: int, max_s: float = 120.0) -> None:
        self.argv = [sys.executable, "-m", "pytest_kvoffload.drive.engine_load", endpoint.url, endpoint.model_name,
                     ",".join(str(n) for n in lengths), str(vocab_size), str(max_s)]
        self.requests = 0
        self.capped = False
        self.errors: list[str] = []
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> "EngineLoad":
        self._proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, text=True)
        first = self._proc.stdout.readline().strip()  # "ready": the engine has answered once
        if first != "ready":
            self.errors.append(first.removeprefix("error ") or "the load's client exited before the engine answered")
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is None:
            return
        self._proc.send_signal(signal.SIGTERM)
        try:
            out, _ = self._proc.communicate(timeout=150)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            out, _ = self._proc.communicate()
        for line in out.splitlines():
            if line.startswith("requests "):
                self.requests = int(line.split()[1])
                self.capped = line.endswith(" capped")
            elif line.startswith("error "):
                self.errors.append(line[6:])


def run_client(url: str, model: str, lengths: list[int], vocab_size: int, max_s: float) -> int:
    endpoint = Endpoint(url, model)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    parent, requests = os.getppid(), 0
    deadline, capped = time.monotonic() + max_s, False
    # The main thread sends: SIGTERM sets `stop` between requests (each is short).
    while not stop.is_set() and os.getppid() == parent:  # never outlive the measuring process
        if time.monotonic() >= deadline:
            capped = True
            break
        length = lengths[requests % len(lengths)]
        prompt = make_prompt(length, 1.0, salt=f"engine-load|{uuid.uuid4().hex}", vocab_size=vocab_size).tokens
        try:
            stream_completion(endpoint, prompt, timeout=120, kv_transfer_params=OPT_OUT)
        except (RequestError, OSError) as exc:
            print(f"error {' '.join(str(exc).split())}", flush=True)
            break
        requests += 1
        if requests == 1:
            print("ready", flush=True)
    print(f"requests {requests}{' capped' if capped else ''}", flush=True)
    return 0


__all__ = ["EngineLoad", "OPT_OUT", "run_client"]


if __name__ == "__main__":
    url, model, lengths, vocab, max_s = sys.argv[1:6]
    sys.exit(run_client(url, model, [int(n) for n in lengths.split(",")], int(vocab), float(max_s)))

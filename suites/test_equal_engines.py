"""Backends are compared on equal engines: gpu-only's and kvoffload-disk's cold prefill agree.

A difference in cold TTFT between two backends is not offload's doing, yet every comparison of their hits
would credit it to offload. It happened: vLLM's CPU build reserves a core for its engine process and one
more when a KV connector is configured, so on 2 cores a connector's engine got both cores and gpu-only's
one, and cold prefill ran twice as fast with a connector (docs/machines.md). Cold rounds of both servers
are interleaved with fresh prompts at the grid's longest length (where a difference in compute shows most
and fixed per-request costs least), who goes first alternating, and the median of their paired ratios must lie within 10% (7 rounds, more up to 21 where it does not).

Between the two requests of a round the previous server must have gone idle: vLLM's worker busy-polls its
message queue for a second after each message (SpinCondition's busy_loop_s in
distributed/device_communicators/shm_broadcast.py), on the core the other server's worker computes on, and
the request sent within that second ran up to 3.8 times slower.

The connector's requests opt out of its store (`"kvoffload": "skip"`): this compares the engines. A cold
request's save is the connector's own cost, and it varies with the drive: in two make test runs a save waited
13 ms for an I/O thread at 384 tokens (median ratios 1.12 and 1.25 with saves; 1.04 to 1.05 in three runs
of it with fewer suites before it); the report's cold cells show it per backend.
"""


import numpy as np
import pytest

from pytest_kvoffload.serve.client import stream_completion
from pytest_kvoffload.analysis.paired import within_cap
from pytest_kvoffload.core.progress import Tracker
from pytest_kvoffload.measure.prompts import make_prompt
from pytest_kvoffload.serve.server import settle

# 7 rounds at the longest length only. In one make test (one-process engines, docs/servers.md) 4 of 5 opted-out
# rounds at 384 tokens came out 9 ms slower on kvoffload-disk (median ratio 1.14; the suite alone gave 0.92
# and 1.02), a fixed per-request cost that the cold cells show, not a difference in compute (1,280 tokens in
# the same run: 1.06). In make bench the second length (2,048) was about two fifths of the suite's 112 s.
ROUNDS = 7
# Outside 10% after 7 rounds: 7 more, twice at most, judged on all rounds (this VM ran 2 to 3 of 7 at 2x on either
# server: docs/notes/2026-12-06-upgrade-and-replay.md). Three looks, each on every round so far.
MAX_ROUNDS = 21
PAIR = ("gpu-only", "kvoffload-disk")


@pytest.mark.kv_servers(*PAIR)
def test_cold_prefill_is_the_same_with_and_without_a_connector(kv_session):
    settings = kv_session.settings
    if not set(PAIR) <= set(settings.backends):
        pytest.skip(f"needs both {' and '.join(PAIR)} among --kv-backend")
    if settings.server_url:
        pytest.skip("--kv-server-url: one external server, nothing to compare")
    base, other = (kv_session.registry.get(name) for name in PAIR)
    lines, unequal = [], []
    last = None

    def cold_ttft(backend, name: str, length: int) -> float:
        """A fresh prompt's client TTFT on `backend`, both servers quiet first where the last request went to
        the other one (whose worker busy-polls the core this one computes on). The order alternates, so a
        round's second server is the next round's first: 9 settles for 16 requests instead of 16 (make bench
        b12: median ratio 0.99, as in b9 with a settle before every request)."""
        nonlocal last
        tokens = make_prompt(length, 0.0, salt=f"{kv_session.salt}|equal|{name}",
                             vocab_size=settings.model.vocab_size).tokens
        if last != backend.name:
            settle([kv_session.endpoint(base), kv_session.endpoint(other)])
        last = backend.name
        skip = {"kvoffload": "skip"} if backend.name == "kvoffload-disk" else None
        return stream_completion(kv_session.endpoint(backend), tokens, kv_transfer_params=skip).client_ttft_s

    lengths = kv_session.lengths[-1:]
    tracker = Tracker(kv_session.progress, "equal engines", len(lengths) * ROUNDS, "rounds",
                      total_work=sum(lengths) * ROUNDS)
    measured = []
    for length in lengths:
        ratios, times = [], []
        # One request each first, not counted: a server's first request after minutes idle took twice
        # as long (149 against 75 ms at 384 tokens).
        for backend in (base, other):
            cold_ttft(backend, f"warm|{backend.name}|{length}", length)
        r = 0
        while r < ROUNDS or (r < MAX_ROUNDS and (r % ROUNDS or not within_cap(ratios))):
            seconds = {}
            # Who goes first alternates: on 2 cores the first request of a round was the slow one in 3 of
            # 5 rounds at 384 tokens (84/72, 77/68, 62/66, 87/68, 61/64 ms, gpu-only always first), a 0.88
            # median that was the order's, not the engines' (their cold cells agreed within 5%).
            for backend in ((base, other) if r % 2 == 0 else (other, base)):  # both stay up on a CPU
                seconds[backend.name] = cold_ttft(backend, f"{backend.name}|{length}|{r}", length)
            seconds = [seconds[base.name], seconds[other.name]]
            ratios.append(seconds[1] / seconds[0])
            times.append(seconds)
            tracker.step(f"{length} tokens, round {r + 1}", work=length)
            r += 1
        median = float(np.median(ratios))
        measured.append({"length": length, "median_ratio": median, "within_cap": within_cap(ratios),
                         "rounds": len(ratios)})
        line = (f"{length} tokens: {other.name} / {base.name} cold TTFT, median ratio {median:.2f} of "
                f"{len(ratios)} rounds; rounds (ms) " + ", ".join(f"{a * 1e3:.0f}/{b * 1e3:.0f}" for a, b in times))
        lines.append(line)
        if not within_cap(ratios):
            unequal.append(line)
    kv_session.add_benchmark("equal engines", "\n".join(lines), {"pair": list(PAIR), "lengths": measured})
    assert not unequal, "engines differ, a difference that would be credited to offload: " + "; ".join(unequal)

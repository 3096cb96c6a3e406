"""Backends are compared on equal engines: gpu-only's and kvoffload-disk's cold prefill agree.

A difference in cold TTFT between two backends is not offload's doing, yet every comparison of their hits
would credit it to offload. It happened: vLLM's CPU build reserves a core for its engine process and one
more when a KV connector is configured, so on 2 cores a connector's engine got both cores and gpu-only's
one, and cold prefill ran twice as fast with a connector (docs/machines.md). Cold rounds of both servers
are interleaved with fresh prompts, and their paired ratios must lie within 10% at every length.
"""

import pytest

from pytest_kvoffload.client import stream_completion
from pytest_kvoffload.paired import within_cap
from pytest_kvoffload.prompts import make_prompt

ROUNDS = 5
PAIR = ("gpu-only", "kvoffload-disk")


def test_cold_prefill_is_the_same_with_and_without_a_connector(kv_session):
    settings = kv_session.settings
    if not set(PAIR) <= set(settings.backends):
        pytest.skip(f"needs both {' and '.join(PAIR)} among --kv-backend")
    if settings.server_url:
        pytest.skip("--kv-server-url: one external server, nothing to compare")
    base, other = (kv_session.registry.get(name) for name in PAIR)
    lines, unequal = [], []
    for length in kv_session.lengths:
        ratios = []
        for r in range(ROUNDS):
            seconds = []
            for backend in (base, other):  # both stay up on a CPU; on a GPU the pool alternates them
                tokens = make_prompt(length, 0.0, salt=f"{kv_session.salt}|equal|{backend.name}|{length}|{r}",
                                     vocab_size=settings.model.vocab_size).tokens
                seconds.append(stream_completion(kv_session.endpoint(backend), tokens).client_ttft_s)
            ratios.append(seconds[1] / seconds[0])
        ratios.sort()
        line = f"{length} tokens: {other.name} / {base.name} cold TTFT, median {ratios[ROUNDS // 2]:.2f} " \
               f"(rounds {ratios[0]:.2f} to {ratios[-1]:.2f})"
        lines.append(line)
        if not within_cap(ratios):
            unequal.append(line)
    kv_session.add_benchmark("equal engines", "\n".join(lines), {"pair": list(PAIR)})
    assert not unequal, "engines differ, a difference that would be credited to offload: " + "; ".join(unequal)

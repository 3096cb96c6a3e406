"""A fraction-1 hit cell's prime as the output reference and, with cold_prime, as the round's cold request
(measure/runner.py), against a fake server whose tier keeps what was computed (no vLLM)."""

from pathlib import Path

import pytest

from pytest_kvoffload.core.models import load_model
from pytest_kvoffload.core.settings import Settings
from pytest_kvoffload.measure import runner as runner_module
from pytest_kvoffload.measure.cells import Cell
from pytest_kvoffload.core.cell_state import State
from pytest_kvoffload.measure.context import Recorder
from pytest_kvoffload.measure.runner import OUTPUT_TOKENS, CellRunner
from pytest_kvoffload.serve.builtin import default_registry
from pytest_kvoffload.serve.client import RequestResult

BLOCK = 128


class FakeServer:
    """A tier that keeps every prompt it computed, whole blocks of it; `cache_everything` makes even the first
    request of a prompt a hit (a prime that was not a computation from scratch)."""

    def __init__(self, cache_everything: bool = False, wrong_after_load: bool = False,
                 cache_first_block: bool = False) -> None:
        self.tier: set[tuple[int, ...]] = set()
        self.requests: list[tuple[int, int, bool]] = []  # (prompt tokens, max_tokens, with a cache_salt)
        self.cache_everything = cache_everything
        self.cache_first_block = cache_first_block  # a first request finds one block of its prompt cached
        self.wrong_after_load = wrong_after_load
        self._last: dict = {}

    def metrics(self):
        return None

    def reset_prefix_cache(self, external: bool) -> None:
        pass

    def complete(self, tokens, max_tokens=1, cache_salt=None, logprobs=None):
        key = tuple(tokens)
        hit = not cache_salt and (key in self.tier or self.cache_everything)
        cached = (len(tokens) - 1) // BLOCK * BLOCK if hit else 0
        if not cache_salt and not hit and self.cache_first_block:
            cached = BLOCK
        self.tier.add(key)
        self.requests.append((len(tokens), max_tokens, bool(cache_salt)))
        output = [sum(tokens) % 1000 + i for i in range(max_tokens)]
        if hit and self.wrong_after_load:
            output[0] += 1
        self._last = {"disk": cached} if cached else {}
        top = [{t: 0.0} for t in output] if logprobs else []
        return RequestResult(len(tokens), 0.01, 0.02, output_token_ids=output, top_logprobs=top)


@pytest.fixture
def server(monkeypatch):
    return install(monkeypatch, FakeServer())


def install(monkeypatch, fake):
    monkeypatch.setattr(runner_module, "stream_completion",
                        lambda ep, tokens, max_tokens=1, cache_salt=None, logprobs=None, **_: fake.complete(
                            tokens, max_tokens, cache_salt, logprobs))

    def attach(ep, before, result):
        result.cached_by_source = dict(fake._last)

    def measure(ep, tokens, max_tokens=1, logprobs=None):
        result = fake.complete(tokens, max_tokens, None, logprobs)
        attach(ep, None, result)
        return result

    monkeypatch.setattr(runner_module, "attach_sources", attach)
    monkeypatch.setattr(runner_module, "measure", measure)
    return fake


def recorder(kept: list) -> Recorder:
    settings = Settings(backends=("kvoffload-disk",), model=load_model("tiny-llama"), lengths=(1025,),
                        fractions=(1.0,), rounds=1, results_dir=Path("/tmp"), block_size=BLOCK)
    return Recorder(settings, "salt", kept.append)


def backend():
    b = default_registry().get("kvoffload-disk")
    # The fake counts whole blocks short of the last token, as vLLM's engine would.
    return type(b)(**{**b.__dict__, "last_block_source": None, "load_proof": None})


def hit_runner(kept, fake, cold_prime: bool, fraction: float = 1.0, check_output: bool = True) -> CellRunner:
    return CellRunner(recorder(kept), backend(), fake, Cell(1025, fraction, State.TIER_HIT),
                      check_output=check_output, cold_prime=cold_prime)


def test_the_prime_is_the_cold_request_and_the_reference(server):
    kept = []
    runner = hit_runner(kept, server, cold_prime=True)
    hit = runner.run(1)
    assert not hit.failures and not runner.colds.failures
    # One prefill (the prime, with the reference's tokens) and the hit: no recompute under a cache_salt.
    assert server.requests == [(1025, OUTPUT_TOKENS, False), (1025, OUTPUT_TOKENS, False)]
    states = [(r["state"], r["fraction"], r["purpose"]) for r in kept]
    assert states == [("cold", 0.0, "measure"), ("tier-hit", 1.0, "measure")]
    assert kept[0]["verified"] and kept[1]["output_matches"]
    assert len(runner.colds.results) == 1 and runner.colds.results[0].cached_by_source == {}


def test_rounds_without_an_output_check_prime_with_one_token(server):
    kept = []
    hit_runner(kept, server, cold_prime=True, check_output=False).run(1)
    assert server.requests == [(1025, 1, False), (1025, 1, False)]


def test_without_cold_prime_the_prime_stays_a_prime_and_still_references(server):
    kept = []
    hit_runner(kept, server, cold_prime=False).run(1)
    assert [r["purpose"] for r in kept] == ["prime", "measure"]
    assert server.requests[0] == (1025, OUTPUT_TOKENS, False) and not any(salted for *_, salted in server.requests)


def test_a_prime_that_was_served_from_cache_is_no_reference_nor_a_cold_request(monkeypatch):
    fake = install(monkeypatch, FakeServer(cache_everything=True))
    kept = []
    runner = hit_runner(kept, fake, cold_prime=True)
    runner.run(1)
    assert runner.colds.failures and "expected a cold request" in runner.colds.failures[0]
    assert fake.requests[-1][2], "the output check must fall back to a recompute under a fresh cache_salt"


def test_wrong_kv_is_caught_against_the_prime(monkeypatch):
    fake = install(monkeypatch, FakeServer(wrong_after_load=True))
    kept = []
    hit = hit_runner(kept, fake, cold_prime=True).run(1)
    assert len(hit.failures) == 1 and "output token 0" in hit.failures[0]


def test_cold_prime_needs_a_prompt_that_is_all_prefix(server):
    with pytest.raises(ValueError, match="all prefix"):
        hit_runner([], server, cold_prime=True, fraction=0.5)


def test_a_prime_with_one_cached_block_is_no_reference_either(monkeypatch):
    """The near miss: 128 of 1,025 tokens served from cache is not a computation from scratch."""
    fake = install(monkeypatch, FakeServer(cache_first_block=True))
    runner = hit_runner([], fake, cold_prime=True)
    runner.run(1)
    assert runner.colds.failures and "128 tokens came from cache" in runner.colds.failures[0]
    assert fake.requests[-1][2], "the output check must fall back to a recompute under a fresh cache_salt"


def test_a_tier_hit_says_whether_a_load_proof_or_only_the_scheduler_verified_it(server):
    from pytest_kvoffload.record.report import render
    kept = []
    hit_runner(kept, server, cold_prime=True).run(1)  # backend() has no load proof, as lmcache-inproc-disk
    assert kept[-1]["state"] == "tier-hit" and kept[-1]["verified_by"] == "scheduler only"
    assert "verified_by" not in kept[0]  # the cold request is no tier hit
    proven = type(backend())(**{**backend().__dict__, "load_proof": lambda counters, tokens, kv: None})
    kept_proven = []
    CellRunner(recorder(kept_proven), proven, server, Cell(1025, 1.0, State.TIER_HIT), cold_prime=True).run(1)
    assert kept_proven[-1]["verified_by"] == "load counters"
    cells = [{"backend": "kvoffload-disk", "length": 1025, "fraction": f, "state": s,
              "ttft": {"p50": 10.0, "spread": 0.0}, "sources": {}, "verified": True}
             for f, s in ((0.0, "cold"), (1.0, "tier-hit"))]
    run = {"backends": {"kvoffload-disk": {"status": "running"}}, "cells": cells}
    assert "proven by vLLM's scheduler only" in render({**run, "measurements": kept})
    assert "proven by vLLM's scheduler only" not in render({**run, "measurements": kept_proven})


def test_lmcache_inproc_disk_is_the_one_tier_backend_without_a_load_proof():
    registry = default_registry()
    unproven = [n for n in registry.names() if registry.get(n).tier and registry.get(n).load_proof is None]
    assert unproven == ["lmcache-inproc-disk"]

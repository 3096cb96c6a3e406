"""The recipe that leaves a prefix in a backend's tier and nowhere above it, step by step (no server)."""

import time

from pytest_kvoffload.measure import runner as measure_module
from pytest_kvoffload.serve.builtin import lmcache_disk as lmcache
from pytest_kvoffload.serve.builtin import default_registry
from pytest_kvoffload.measure.runner import place_in_tier_only


class Recorder:
    def __init__(self, counters=()) -> None:
        self.steps = []
        self.counters = list(counters)  # what the server's counters read, poll by poll (the last one stays)

    def reset_prefix_cache(self, external: bool) -> None:
        self.steps.append(("reset", external))

    def metrics(self):
        self.steps.append(("metrics",))
        extra = self.counters.pop(0) if len(self.counters) > 1 else (self.counters or [{}])[0]
        return type("Snapshot", (), {"extra": extra})()


def recipe(monkeypatch, name, counters=()):
    endpoint = Recorder(counters)
    monkeypatch.setattr(measure_module, "measure", lambda ep, tokens: ep.steps.append(("prime", len(tokens))) or "r")
    monkeypatch.setattr(measure_module, "stream_completion", lambda ep, tokens: ep.steps.append(("step", len(tokens))))
    primes = place_in_tier_only(endpoint, default_registry().get(name), list(range(100)))
    return endpoint.steps, primes


def test_disk_tiers_below_the_engine_keep_the_prefix_through_an_engine_reset(monkeypatch):
    steps, primes = recipe(monkeypatch, "kvoffload-disk")
    assert steps == [("prime", 100), ("reset", False)] and primes == ["r"]
    steps, primes = recipe(monkeypatch, "lmcache-disk", [SETTLED])
    assert steps == [("prime", 100), ("reset", False), ("metrics",)] and primes == ["r"]


# LMCache's server counters (totals) as b45's 2,048 x 1 cell left them after its second round's prime: the
# store to the disk tier submitted, not completed, the chunks still in L1; that round's hit was served from L1.
IN_FLIGHT = {lmcache.L2_STORE_SUBMITTED: 16, lmcache.L2_STORE_COMPLETED: 8, lmcache.L1_WRITTEN: 24,
             lmcache.L1_EVICTED: 16}
STORED_NOT_EVICTED = {**IN_FLIGHT, lmcache.L2_STORE_COMPLETED: 16}
SETTLED = {**STORED_NOT_EVICTED, lmcache.L1_EVICTED: 24}


def test_lmcache_is_measured_only_once_its_store_completed_and_l1_let_the_chunks_go(monkeypatch):
    assert not lmcache.tier_settled(IN_FLIGHT) and not lmcache.tier_settled(STORED_NOT_EVICTED)
    assert lmcache.tier_settled(SETTLED) and lmcache.tier_settled({})
    steps, _ = recipe(monkeypatch, "lmcache-disk", [IN_FLIGHT, IN_FLIGHT, STORED_NOT_EVICTED, SETTLED])
    assert steps == [("prime", 100), ("reset", False)] + [("metrics",)] * 4


def test_a_tier_that_never_settles_is_measured_after_the_deadline(monkeypatch):
    monkeypatch.setattr(measure_module, "SETTLE_S", 0.1)
    monkeypatch.setattr(measure_module.wait_until_settled, "__defaults__", (0.1,))
    started = time.monotonic()
    steps, primes = recipe(monkeypatch, "lmcache-disk", [IN_FLIGHT])
    assert 0.1 <= time.monotonic() - started < 2 and primes == ["r"] and steps.count(("metrics",)) > 1


def test_native_cpu_is_primed_twice_with_the_engine_emptied_between(monkeypatch):
    steps, primes = recipe(monkeypatch, "native-cpu")
    assert steps == [("prime", 100), ("reset", False), ("prime", 100), ("reset", False)] and len(primes) == 2


def test_native_disk_drains_its_cpu_tier_and_lets_the_reset_flush(monkeypatch):
    steps, _ = recipe(monkeypatch, "native-disk")
    assert steps == [("prime", 100), ("reset", True), ("step", 8)]

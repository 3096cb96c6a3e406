"""The recipe that leaves a prefix in a backend's tier and nowhere above it, step by step (no server)."""

from pytest_kvoffload.measure import runner as measure_module
from pytest_kvoffload.serve.builtin_backends import default_registry
from pytest_kvoffload.measure.runner import place_in_tier_only


class Recorder:
    def __init__(self) -> None:
        self.steps = []

    def reset_prefix_cache(self, external: bool) -> None:
        self.steps.append(("reset", external))


def recipe(monkeypatch, name):
    endpoint = Recorder()
    monkeypatch.setattr(measure_module, "measure", lambda ep, tokens: ep.steps.append(("prime", len(tokens))) or "r")
    monkeypatch.setattr(measure_module, "stream_completion", lambda ep, tokens: ep.steps.append(("step", len(tokens))))
    primes = place_in_tier_only(endpoint, default_registry().get(name), list(range(100)))
    return endpoint.steps, primes


def test_disk_tiers_below_the_engine_keep_the_prefix_through_an_engine_reset(monkeypatch):
    for name in ("kvoffload-disk", "lmcache-disk"):
        steps, primes = recipe(monkeypatch, name)
        assert steps == [("prime", 100), ("reset", False)] and primes == ["r"]


def test_native_cpu_is_primed_twice_with_the_engine_emptied_between(monkeypatch):
    steps, primes = recipe(monkeypatch, "native-cpu")
    assert steps == [("prime", 100), ("reset", False), ("prime", 100), ("reset", False)] and len(primes) == 2


def test_native_disk_drains_its_cpu_tier_and_lets_the_reset_flush(monkeypatch):
    steps, _ = recipe(monkeypatch, "native-disk")
    assert steps == [("prime", 100), ("reset", True), ("step", 8)]

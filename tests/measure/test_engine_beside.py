"""A tier-hit round's engine hit beside it (measure/runner.py, paired_engine): measured after the tier hit,
outside its timing, on a prompt with the same prefix and a suffix of its own, its sources checked; a round
whose engine hit did not come from the engine's cache carries the problem (analysis/tier_limit.py leaves it
out). Against the fake server of test_cold_prime.py (no vLLM)."""

from pytest_kvoffload.core.cell_state import State
from pytest_kvoffload.measure.cells import Cell
from pytest_kvoffload.measure.runner import CellRunner
from test_cold_prime import FakeServer, backend, install, recorder


class EngineFake(FakeServer):
    """Per round: the prime (the prefix alone) computed, the next whole prompt a tier hit of the prefix, the
    one after it (the engine hit beside) served from `source`."""

    def __init__(self, source: str = "device") -> None:
        super().__init__()
        self.source = source
        self.prompts: list[tuple[int, ...]] = []
        self.since_prime = 0

    def complete(self, tokens, max_tokens=1, cache_salt=None, logprobs=None):
        result = super().complete(tokens, max_tokens, cache_salt, logprobs)
        self.prompts.append(tuple(tokens))
        if len(tokens) < 1025:
            self.since_prime, self._last = 0, {}
        else:
            self.since_prime += 1
            self._last = {"disk" if self.since_prime == 1 else self.source: 512}
        return result


def run(monkeypatch, fake, paired=True, fraction=0.5):
    install(monkeypatch, fake)
    kept = []
    CellRunner(recorder(kept), backend(), fake, Cell(1025, fraction, State.TIER_HIT), check_output=False,
               paired_engine=paired).run(2)
    return kept, fake


def test_each_tier_hit_round_carries_an_engine_hit_of_its_prefix_with_a_suffix_of_its_own(monkeypatch):
    kept, fake = run(monkeypatch, EngineFake())
    hits = [r for r in kept if r["purpose"] == "measure"]
    assert len(hits) == 2 and all(r["engine_beside_s"] > 0 for r in hits)
    # Per round: the prime (the prefix), the tier hit, then the engine hit beside it: same prefix, other suffix.
    hit, beside = fake.prompts[1], fake.prompts[2]
    prefix = 512
    assert len(hit) == len(beside) == 1025 and hit[:prefix] == beside[:prefix] and hit[prefix:] != beside[prefix:]
    assert all(r["engine_beside_problem"] is None for r in hits)


def test_an_engine_hit_from_the_wrong_place_is_named(monkeypatch):
    kept, _ = run(monkeypatch, EngineFake(source="disk"))
    assert all(r["engine_beside_problem"] for r in kept if r["purpose"] == "measure")


def test_without_pairing_no_engine_hit_is_sent(monkeypatch):
    kept, fake = run(monkeypatch, EngineFake(), paired=False)
    assert len(fake.prompts) == 4 and not any("engine_beside_s" in r for r in kept)


def test_a_round_that_reuses_a_prompt_sends_no_prime_and_the_same_prompt(monkeypatch):
    kept, fake = run(monkeypatch, EngineFake(), fraction=1.0)
    first_hit = fake.prompts[1]
    again = []
    CellRunner(recorder(again), backend(), fake, Cell(1025, 1.0, State.TIER_HIT), first_round=2, purpose="tier-limit",
               check_output=False, paired_engine=True, reuse=("measure", 1)).run(1)
    assert fake.prompts[-2] == first_hit and fake.prompts[-1] == first_hit  # the tier hit, then the engine hit
    assert len(fake.prompts) == 6 + 2 and [r["purpose"] for r in again] == ["tier-limit"]


def test_only_a_whole_prefix_tier_hit_may_reuse_a_prompt():
    import pytest
    with pytest.raises(ValueError, match="all prefix"):
        CellRunner(recorder([]), backend(), EngineFake(), Cell(1025, 0.5, State.TIER_HIT), reuse=("measure", 1))


def test_the_limit_rounds_prime_once_and_reuse_that_prompt(monkeypatch):
    from pytest_kvoffload.suite_machinery.ttft_limits import more_rounds
    fake = EngineFake()
    install(monkeypatch, fake)
    kept = []
    failures = more_rounds(recorder(kept), backend(), fake, [Cell(1025, 1.0, State.TIER_HIT)], grid_rounds=2, pairs=5)
    # 3 rounds: the first primes (prime, tier hit, engine hit), the other two reuse its prompt (tier hit, engine hit).
    assert len(fake.prompts) == 3 + 2 + 2 and len(set(fake.prompts)) == 1
    assert [r["round"] for r in kept if r["purpose"] == "tier-limit"] == [3, 4, 5] and isinstance(failures, list)

"""The one definition of "a load pays": what a load adds and what recompute it replaces."""

import pytest

from pytest_kvoffload.connector.admission_rule import Admission
from pytest_kvoffload.connector.counters import Counters
from pytest_kvoffload.core.costs import RecomputeFit, load_and_recompute

FIT = RecomputeFit(a=0.01, b=1e-4, c=1e-8)


def test_a_whole_prompt_load_replaces_the_recompute_of_one_token_fewer():
    whole = load_and_recompute(1024, 0, FIT, 0.02, 1e-6, prompt_tokens=1024)
    assert whole[1] == pytest.approx(FIT(1023) - FIT(0))
    assert whole[0] == pytest.approx(0.02 - FIT.a + 1024e-6)  # the load still moves every token
    # The controls: a prefix shorter than the prompt, or no prompt length, replaces all it loads.
    assert load_and_recompute(512, 0, FIT, 0.02, 1e-6, prompt_tokens=1024)[1] == pytest.approx(FIT(512) - FIT(0))
    assert load_and_recompute(1024, 0, FIT, 0.02, 1e-6)[1] == pytest.approx(FIT(1024) - FIT(0))
    # On top of local tokens: the recompute from them to one token short of the prompt's end.
    assert load_and_recompute(512, 512, FIT, 0.02, 1e-6, prompt_tokens=1024)[1] == pytest.approx(FIT(1023) - FIT(512))


def test_the_admission_rule_prices_a_whole_prompt_load_the_same_way():
    tier = {"recompute": {"a": FIT.a, "b": FIT.b, "c": FIT.c}, "bandwidth_gbps": 4.0, "fixed_s": 0.02, "margin": 0.0}
    rule = Admission(tier, 4096, Counters(), "static")
    assert rule.predicted(1024, 0, 1024)[1] == pytest.approx(FIT(1023) - FIT(0))
    assert rule.predicted(1024, 0)[1] == pytest.approx(FIT(1024) - FIT(0))

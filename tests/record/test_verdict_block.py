"""summary.txt opens with the run's verdicts, one line each, within its first 40 lines; the disk-speed
section is a few lines; planted failures show as missed."""

import json
from pathlib import Path

from pytest_kvoffload.record.roles import with_roles
from pytest_kvoffload.serve.builtin import builtin_backends
from pytest_kvoffload.record.summary_text import summary_text
from pytest_kvoffload.record.verdict_block import verdict_lines

RUN = Path(__file__).parents[1] / "fixtures" / "report" / "make-test-run.json"


def run():
    """The committed make test run (recorded before roles), each backend with its built-in role."""
    return with_roles(json.loads(RUN.read_text()), {b.name: b.role for b in builtin_backends()})


def test_the_summary_opens_with_the_verdicts_in_its_first_40_lines():
    text = summary_text(run()).splitlines()
    assert text[0].startswith("verdicts of run 20261204-225253-tiny-llama-vm: 0 missed, 0 undecided")
    block = text[:text.index("")]
    assert len(block) <= 40
    whats = " ".join(block)
    for expected in ("sources:", "outputs:", "tier target", "admission:", "A/B against itself", "break-even",
                     "kvoffload-disk speed"):
        assert expected in whats, expected


def test_the_disk_speed_section_is_at_most_5_lines():
    text = summary_text(run()).splitlines()
    start = text.index("kvoffload-disk speed:")
    section = text[start + 1:text.index("", start)]
    assert 1 <= len(section) <= 5 and "run.json" in section[-1]


def test_planted_failures_are_missed_and_planted_servers_do_not_count():
    r = run()
    measured = [m for m in r["measurements"] if m.get("output_checked") and m["backend"] == "native-cpu"]
    measured[0]["output_matches"] = False
    fault = [m for m in r["measurements"] if m["backend"] == "kvoffload-disk[fault]"]
    assert fault and any(m.get("verified") is False for m in fault)  # its failures are its test's
    lines = {v.what: v for v in verdict_lines(r)}
    assert lines["outputs"].outcome == "missed" and lines["sources"].outcome == "met"
    r["benchmarks"]["admission"]["frontier"][0]["wrong"] = 5
    assert {v.what: v for v in verdict_lines(r)}["admission"].outcome == "missed"

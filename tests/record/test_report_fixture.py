"""The report a user reads from a saved run does not change when the code is moved or refactored: `kvoffload
report` on a committed run.json (a make bench night with five backends) must print, byte for byte, the text
committed beside it. After an intended change to the report, regenerate it with
`kvoffload report tests/fixtures/compare/night-a > tests/fixtures/report/night-a.txt` and review the diff."""

from pathlib import Path

from pytest_kvoffload.cli import main

FIXTURES = Path(__file__).parents[1] / "fixtures"


def test_report_of_a_committed_run_is_byte_equal(capsys):
    assert main(["report", str(FIXTURES / "compare" / "night-a")]) == 0
    printed = capsys.readouterr().out
    assert printed == (FIXTURES / "report" / "night-a.txt").read_text()

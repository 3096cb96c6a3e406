"""Every server earns its start-up: the plan of servers read from the collected tests, the closing line on
start-ups, and make test's own plan held to a stated count (no server starts here)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_kvoffload.harness.server_plan import Plan, base_name, startup_line

ROOT = Path(__file__).resolve().parents[2]
# make test's servers, one start-up each (docs/servers.md lists them and why). Raising this is a decision:
# every server costs 26 to 61 s on 2 cores, and make test has 12 minutes.
MAKE_TEST_SERVERS = 12

PLANNED = """
import pytest

kvoffload = pytest.mark.parametrize("kv_backend", ["kvoffload-disk"], indirect=True, scope="session")

@kvoffload
def test_uses_the_server(kv_server):
    pass

@kvoffload
def test_uses_it_again(kv_server):
    pass

@kvoffload
def test_needs_no_server(kv_backend):
    pass

@kvoffload
@pytest.mark.kv_servers("{backend}[slow]", "gpu-only", "lmcache-inproc-disk")
def test_starts_variants(kv_session, kv_backend):
    pass

@pytest.mark.kv_servers("{ab}")
def test_ab_without_a_pair(kv_session):
    pass
"""


@pytest.fixture(autouse=True)
def cpu_machine(monkeypatch):
    monkeypatch.setenv("KVOFFLOAD_DEVICE", "cpu")


def test_the_plan_lists_each_server_once_with_the_tests_that_start_it(pytester):
    pytester.makepyfile(test_planned=PLANNED)
    result = pytester.runpytest_subprocess("--kv-server-plan", "-p", "no:cacheprovider")
    out = result.stdout.str()
    assert result.ret == 0, out
    assert "kvoffload: 3 servers planned" in out
    assert "kvoffload-disk: test_planned.py::test_uses_the_server[kvoffload-disk] and 1 more" in out
    assert "kvoffload-disk[slow]: test_planned.py::test_starts_variants[kvoffload-disk]" in out
    assert "gpu-only: test_planned.py::test_starts_variants" in out
    assert "  lmcache-inproc-disk:" not in out  # it needs a GPU: its tests skip
    assert "passed" not in out and not (pytester.path / "results").exists()  # nothing ran, nothing started


def test_an_ab_pair_is_planned_from_kv_ab(pytester):
    pytester.makepyfile(test_planned=PLANNED)
    out = pytester.runpytest_subprocess("--kv-server-plan", "--kv-ab", "gpu-only,gpu-only",
                                        "-p", "no:cacheprovider").stdout.str()
    assert "kvoffload: 4 servers planned" in out and "gpu-only~b: test_planned.py::test_ab_without_a_pair" in out


def test_the_closing_line_counts_restarts_and_names_unplanned_servers():
    plan = Plan({"a": ["t1"], "b": ["t2"]})
    line = startup_line([("a", 61.0), ("b", 30.0), ("a", 26.0), ("c", 33.0)], plan)
    assert line.startswith("server start-ups: 4 (3 servers, 1 restarted), 150 s in all; first 61 s, later 26 to 33 s")
    assert "planned 2; NOT PLANNED (mark the test kv_servers): c" in line
    assert "NOT PLANNED" not in startup_line([("a", 10.0)], plan)
    assert startup_line([], plan) == "server start-ups: none"


def test_variant_and_twin_names_derive_from_their_backend():
    assert base_name("kvoffload-disk[slow]") == "kvoffload-disk"
    assert base_name("kvoffload-disk~b") == "kvoffload-disk"
    assert base_name("gpu-only") == "gpu-only"


def documented_servers() -> list[str]:
    """The server names in docs/servers.md's table of make test's servers (first column, in backticks)."""
    text = (ROOT / "docs" / "servers.md").read_text()
    table = text.split("## The servers make test starts", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([^`]+)` \|", table, flags=re.MULTILINE)


def test_make_tests_plan_is_the_documented_one_and_within_its_count():
    args = subprocess.run(["make", "-s", "test-args"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    result = subprocess.run([sys.executable, "-m", "pytest", "tests", "suites", *args, "--kv-server-plan", "-q",
                             "-p", "no:cacheprovider"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    planned = re.findall(r"^  (\S+): (?:tests|suites)/", result.stdout, flags=re.MULTILINE)
    assert planned, result.stdout + result.stderr
    assert sorted(planned) == sorted(documented_servers()), (
        "make test's servers changed: update docs/servers.md (and MAKE_TEST_SERVERS) on purpose")
    assert len(planned) <= MAKE_TEST_SERVERS, f"make test plans {len(planned)} servers, at most {MAKE_TEST_SERVERS}"

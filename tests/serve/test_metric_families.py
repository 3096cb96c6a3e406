"""Each release's metric families, the ones the harness reads, against a live server (tests/serve/golden/).

A rename in a vLLM release would otherwise blank a column silently: cached tokens by source read as 0 look
like a cold request. make test checks its own vLLM's servers; make upgrade the older release's too."""

import json
from pathlib import Path

import pytest

from pytest_kvoffload.core.vllm_releases import RELEASES
from pytest_kvoffload.serve.metrics import family_problems, snapshot

GOLDEN = Path(__file__).parent / "golden"


def golden(series: str) -> dict | None:
    path = GOLDEN / f"metrics-vllm-{series}.json"
    return json.loads(path.read_text()) if path.exists() else None


@pytest.mark.server
def test_a_live_server_exposes_its_releases_families(kv_backend, kv_server):
    release = kv_server.release
    facts = golden(release.series)
    if facts is None:
        pytest.skip(f"no golden metric families for vLLM {release.series} (the CUDA build: recorded on a GPU run)")
    problems = family_problems(kv_server.metrics_text(), facts["families"], f"{kv_backend.name} (vLLM {release.series})")
    assert not problems, problems[0]


@pytest.mark.parametrize("series", ["0.31", "0.32"])
def test_the_recorded_text_meets_its_golden_file_and_a_planted_rename_fails_in_one_line(series):
    facts = golden(series)
    text = (GOLDEN / f"metrics-vllm-{facts['vllm']}.txt").read_text()
    assert family_problems(text, facts["families"], "recorded") == []
    cached = RELEASES[series].cached_family
    renamed = family_problems(text.replace(cached, cached + "_v2"), facts["families"], "planted")
    assert len(renamed) == 1 and "\n" not in renamed[0]
    assert renamed[0].startswith(f"{cached}: absent from planted's /metrics")
    relabelled = family_problems(text.replace('source="', 'origin="'), facts["families"], "planted")
    assert relabelled[0] == f"{cached}: planted's /metrics has no label source"


def test_every_release_measured_here_has_a_golden_file():
    for series, release in RELEASES.items():
        if "cpu" in release.builds:
            facts = golden(series)
            assert facts and facts["vllm"] in release.measured_here
            assert release.cached_family in facts["families"]


def test_cached_tokens_by_source_are_read_as_each_release_counts_them():
    old = snapshot((GOLDEN / "metrics-vllm-0.31.0.txt").read_text(), release=RELEASES["0.31"])
    assert old.cached_by_source == {"device": 7168, "external": 8064}  # local_compute is not cached
    new = snapshot((GOLDEN / "metrics-vllm-0.32.0.txt").read_text(), release=RELEASES["0.32"])
    assert new.cached_by_source == {"device": 7168, "host": 0, "p2p": 0, "disk": 8064, "external_unspecified": 0}
    assert old.prompt_tokens == 46032

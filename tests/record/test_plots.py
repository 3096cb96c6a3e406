import pytest

from pytest_kvoffload.analysis.fits import analyse
from pytest_kvoffload.record.plots import plot_ttft_by_length, write_all
from pytest_kvoffload.analysis.cell_stats import cell_table

matplotlib = pytest.importorskip("matplotlib")


def record(backend, state, length, ttft, fraction=1.0):
    return {"backend": backend, "length": length, "fraction": 0.0 if state == "cold" else fraction, "state": state,
            "purpose": "measure", "prompt_tokens": length, "client_ttft_s": ttft, "cached_by_source": {}}


def test_ttft_plot_is_a_png_with_one_line_per_backend_and_state(tmp_path, monkeypatch):
    ms = [record(b, s, n, t * n / 1000) for b in ("gpu-only", "kvoffload-disk") for n in (512, 1024, 2048)
          for s, t in (("cold", 1.0), ("engine-hit", 0.2))]
    ms += [record("kvoffload-disk", "tier-hit", n, 0.3 * n / 1000) for n in (512, 1024, 2048)]
    run = {"cells": cell_table(ms), "options": {"model": {"name": "tiny-llama"}}}
    lines = []
    import matplotlib.axes
    original = matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", lambda self, *a, **k: lines.append(k["label"]) or original(self, *a, **k))
    path = plot_ttft_by_length(run, tmp_path / "ttft.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(lines) == 5 and "kvoffload-disk: tier hit" in lines


def test_no_cells_no_plot(tmp_path):
    assert plot_ttft_by_length({"cells": []}, tmp_path / "x.png") is None


def test_all_plots_from_a_run_with_a_tier(tmp_path):
    ms = []
    for n in (512, 1024, 2048, 4096):
        ms.append(record("kvoffload-disk", "cold", n, 0.02 + n * 2e-4))
        ms.append(record("kvoffload-disk", "engine-hit", n, 0.03))
        ms.append(record("kvoffload-disk", "tier-hit", n, 0.035 + n * 4096 / 5e8))
    for m in ms:
        if m["state"] != "cold":
            m["cached_by_source"] = {"device" if m["state"] == "engine-hit" else "disk": m["length"] - 128}
    cells = cell_table(ms)
    run = {"cells": cells, "analysis": analyse(cells, 4096, {"kvoffload-disk": "disk"}),
           "options": {"model": {"name": "tiny-llama"}}}
    # A process drawing on another backend keeps it (svg here, so a switch to Agg would show).
    backend = matplotlib.get_backend()
    matplotlib.use("svg")
    try:
        made = write_all(run, tmp_path)
        assert matplotlib.get_backend() == "svg", "drawing switched the process's matplotlib backend"
    finally:
        matplotlib.use(backend)
    assert [p.name for p in made] == ["ttft_by_length.png", "break_even_bandwidth.png", "frontier.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in made)

"""report.html and the comparison page, read as a person would get them: every section there, every picture
decodes, nothing fetched from elsewhere, the verdicts on the first screen of a headless browser."""

import base64
import io
import json
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from pytest_kvoffload.cli import main
from pytest_kvoffload.record.html_report import render_run_page
from pytest_kvoffload.analysis.cell_stats import cell_table

FIXTURES = Path(__file__).parents[1] / "fixtures"
RUN_SECTIONS = ("verdicts", "ttft", "break-even", "admission", "side-by-side", "tier-limits", "machine", "logs")


class Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.ids, self.images, self.references, self.rows = [], [], [], []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "id" in attrs:
            self.ids.append(attrs["id"])
        if tag == "img":
            self.images.append(attrs.get("src", ""))
        for key in ("src", "href"):
            if key in attrs and tag != "img":
                self.references.append(attrs[key])
        if tag == "script" or (tag == "link" and attrs.get("rel") == "stylesheet"):
            self.references.append(f"<{tag}>")
        if tag == "tr":
            self.rows.append(attrs.get("class", ""))


def parse(html: str) -> Page:
    page = Page()
    page.feed(html)
    return page


def decodes(src: str) -> bool:
    from matplotlib.image import imread
    assert src.startswith("data:image/png;base64,"), src[:40]
    image = imread(io.BytesIO(base64.b64decode(src.split(",", 1)[1])), format="png")
    return image.shape[0] > 100 and image.shape[1] > 100 and image.std() > 0


def run_with_rounds(tmp_path) -> tuple[dict, Path]:
    """make test's run of 2026-12-04 (every suite, 5 backends), and a run folder with one log."""
    run = json.loads((FIXTURES / "report" / "make-test-run.json").read_text())
    folder = tmp_path / "run"
    (folder / "logs").mkdir(parents=True)
    (folder / "logs" / "gpu-only.log").write_text("a server's log\n")
    return run, folder


def test_every_section_is_there_every_picture_decodes_and_nothing_is_fetched(tmp_path):
    run, folder = run_with_rounds(tmp_path)
    html = render_run_page(run, folder)
    page = parse(html)
    assert [i for i in RUN_SECTIONS if i in page.ids] == list(RUN_SECTIONS)
    assert page.ids.index("verdicts") == 0  # the verdicts come first
    assert len(page.images) == 3 and all(decodes(src) for src in page.images)
    assert all(not r.startswith(("http:", "https:", "//", "<")) for r in page.references), page.references
    assert "logs/gpu-only.log" in page.references
    assert len(html.encode()) < 2 * 2**20


def test_the_verdicts_name_what_was_judged_and_a_missed_one_is_marked(tmp_path):
    run, folder = run_with_rounds(tmp_path)
    run["measurements"] = [{"backend": "gpu-only", "length": 512, "fraction": 1.0, "state": "engine-hit",
                            "purpose": "measure", "verified": True, "output_checked": True, "output_matches": m}
                           for m in (True, False)]
    page = parse(render_run_page(run, folder))
    assert "missed" in page.rows and "met" in page.rows


def test_a_comparison_page_shows_a_planted_regression_as_a_failing_cell(tmp_path):
    run = json.loads((FIXTURES / "compare" / "make-test" / "run.json").read_text())
    for m in run["measurements"]:
        if m["backend"] == "kvoffload-disk" and m["state"] == "tier-hit":
            m["client_ttft_s"] *= 1.3
    run["cells"] = cell_table(run["measurements"])
    (tmp_path / "slower").mkdir()
    (tmp_path / "slower" / "run.json").write_text(json.dumps(run))
    out = tmp_path / "compare.html"
    assert main(["compare", str(FIXTURES / "compare" / "make-test"), str(tmp_path / "slower"), "--html", str(out)]) == 1
    html = out.read_text()
    page = parse(html)
    assert page.ids[0] == "verdicts" and "cells" in page.ids
    assert page.rows.count("missed") >= 2  # the group and its cells
    assert "kvoffload-disk tier-hit over 4 cell(s)" in html and not page.images and not page.references
    assert main(["compare", str(FIXTURES / "compare" / "make-test"), str(tmp_path / "slower"),
                 "--html", str(tmp_path / "no" / "such" / "folder.html")]) == 2


BROWSER = shutil.which("chromium") or shutil.which("chromium-browser")
# The verdict block's bar (record/templates/page.css): a colour nowhere else on the page.
BAR = (0x0B, 0x3D, 0x91)


@pytest.mark.skipif(BROWSER is None, reason="no headless browser: apt-get install chromium (docs/results.md)")
def test_a_headless_browser_shows_the_verdicts_on_the_first_screen(tmp_path):
    import numpy as np
    from matplotlib.image import imread
    run, folder = run_with_rounds(tmp_path)
    page = folder / "report.html"
    page.write_text(render_run_page(run, folder))
    shot = tmp_path / "shot.png"
    subprocess.run([BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    f"--user-data-dir={tmp_path / 'profile'}", "--hide-scrollbars", "--window-size=1280,800",
                    f"--screenshot={shot}", page.as_uri()], capture_output=True, timeout=120, check=False)
    assert shot.is_file(), "the browser wrote no screenshot"
    pixels = (imread(str(shot))[..., :3] * 255).round().astype(int)
    assert pixels.shape[:2] == (800, 1280) and pixels.std() > 10  # not blank
    bar = np.all(np.abs(pixels - np.array(BAR)) <= 2, axis=-1)
    assert bar.sum() > 2000, "the verdict block's bar is not on the first screen"
    assert np.nonzero(bar.any(axis=1))[0].min() < 400  # in the upper half, without scrolling


def test_the_page_shows_each_tier_against_its_limit_with_a_miss_marked(tmp_path):
    run, folder = run_with_rounds(tmp_path)
    cell = {"length": 1280, "fraction": 1.0, "estimate": 1.09, "low": 1.01, "high": 1.13, "outcome": "missed"}
    run.setdefault("analysis", {})["kvoffload-disk"] = {
        **run["analysis"].get("kvoffload-disk", {}), "tier_limit": {"medium": "drive", "gbps": 4.0, "cells": [cell]}}
    page = parse(render_run_page(run, folder))
    assert "tier-limits" in page.ids and "missed" in page.rows

"""The report fits a screen: opened in real headless Chromium 1,400 px wide, the page is no wider
than the window (the page measures ``document.documentElement.scrollWidth`` itself, into its
render marker), every plot renders, the overall gain comes first and the per-trial tables are
collapsed. A screenshot is kept in the test's tmp directory."""

from __future__ import annotations

import html
import re
from pathlib import Path

import pytest

from support import cli
from support.shared_runs import shared_small
from test_report import _marker, _run_chromium

WIDTH = 1400
SIZES = re.compile(r'id="report-check"[^>]*data-scroll-width="(\d+)" data-scroll-height="(\d+)"')


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = shared_small(tmp_path_factory)
    out = tmp_path_factory.mktemp("layout") / "report.html"
    result = cli("report", "small", "-o", str(out), "--run-steps", "2000", cwd=directory)
    assert result.returncode == 0, result.stderr
    return out


def test_the_report_is_no_wider_than_a_1400_px_window(report: Path, tmp_path: Path) -> None:
    dom = _run_chromium(report, tmp_path / "profile", f"--window-size={WIDTH},900", "--dump-dom").stdout
    expected, rendered, errors = _marker(dom)
    assert rendered == expected and errors == []
    sizes = SIZES.search(dom)
    assert sizes, "the page never measured itself: " + dom[-2000:]
    width, height = int(sizes.group(1)), int(sizes.group(2))
    print(f"report at {WIDTH} px: scrollWidth {width}, scrollHeight {height}")
    assert width <= WIDTH
    # The systems stage varies ~17 parameters: its slice plots hold 4 each, not 17 in one row.
    assert "systems: η against the stage's parameters (1 of" in html.unescape(report.read_text())

    shot = tmp_path / "report-1400.png"
    _run_chromium(report, tmp_path / "profile2", f"--window-size={WIDTH},2000", f"--screenshot={shot}")
    from PIL import Image

    with Image.open(shot) as image:
        assert image.size == (WIDTH, 2000)
        colours = image.convert("RGB").getcolors(maxcolors=1_000_000)
    assert colours is not None and len(colours) > 100, "a drawn page has many colours, a blank one few"
    print(f"screenshot: {shot}")


def test_the_overall_gain_comes_first_and_per_trial_tables_are_collapsed(report: Path) -> None:
    text = html.unescape(report.read_text())
    body = text[text.index("<body>"):]
    first = body.index('<div class="overall">')
    assert first < body.index("<h2>")  # before every section
    box = body[first:body.index("</div>", first)]
    assert "SIMULATED overall gain against your baseline: η " in box
    assert "SIMULATED cost: " in box and "break-even after" in box
    # the small study's final config is its systems stage's: its 2 runs in the mini-batch stage
    # carried over, re-timed
    for summary in ("GPU utilisation of every trial", "its 2 runs"):
        assert re.search(r"<details><summary>" + re.escape(summary), body), summary
    assert len(re.findall(r"final config \(the run of small\.minibatch\.t\d+ carried over, re-timed ×", body)) == 2
    # the pruned and failed trials: a collapsed table, or the line that says there were none
    assert (re.search(r"<details><summary>every pruned or failed trial", body)
            or "No trial was pruned or failed." in body)

"""The run report as a real browser sees it: headless Chromium loads the page from disk, with no network."""

from __future__ import annotations

import base64
import io
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from matplotlib import image as mpimg

from asyncrl.debug.report import write_report
from tests._synthetic_run import ANOMALIES, HOSTILE, make_run, parse_page

pytestmark = [pytest.mark.integration]

SECTION_IDS = ("summary", "curves", "staleness", "logprobs", "guard", "anomalies", "samples", "throughput")


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> Path:
    return write_report(make_run(tmp_path_factory.mktemp("run") / "run"))


def _chromium(page: Path, profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """One headless Chromium run on the page, isolated from the network and from any user profile."""
    browser = shutil.which("chromium")
    if browser is None:
        pytest.skip("headless browser test needs `chromium` on PATH (Debian package chromium)")
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={profile}", *args, page.resolve().as_uri()]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done


def test_browser_dom_has_every_section_and_decodable_images(page, tmp_path):
    dom = _chromium(page, tmp_path / "profile", "--dump-dom").stdout
    sections, urls = parse_page(dom)
    assert tuple(sections) == SECTION_IDS
    assert all(s.h2.strip() for s in sections.values())
    images = [src for s in sections.values() for src in s.images]
    assert len(images) >= 8
    for src in images:
        assert src.startswith("data:image/png;base64,")
        pixels = mpimg.imread(io.BytesIO(base64.b64decode(src.partition(",")[2])), format="png")
        assert pixels.ndim == 3 and min(pixels.shape[:2]) > 50
    assert all(u.startswith(("data:", "#", "../dumps/")) for u in urls), urls
    assert len(sections["anomalies"].links) == 4  # each anomaly: its dump and its batch's samples


def test_browser_renders_the_samples_table_as_text(page, tmp_path):
    # the DOM as the browser built it: the samples section holds a table per sampled batch, the completions are
    # text (the hostile one did not end its cell or add a script element), and each anomaly's link lands on a
    # heading of that section
    dom = _chromium(page, tmp_path / "profile", "--dump-dom").stdout
    sections, _ = parse_page(dom)
    assert HOSTILE in sections["samples"].text
    assert "<script" not in dom.split('id="samples"', 1)[1]
    block = dom.split('id="samples"', 1)[1].split("</section>", 1)[0]
    assert block.count("<table>") == 8 and block.count("<tr>") == 8 + 3 * 2 * 4 + 2 * 8
    for step, rank, *_ in ANOMALIES:
        assert f'<h3 id="samples-step{step}-rank{rank}">' in block
        assert f'href="#samples-step{step}-rank{rank}"' in dom


def test_browser_screenshot_is_a_rendered_page(page, tmp_path):
    shot = tmp_path / "shot.png"
    _chromium(page, tmp_path / "profile", f"--screenshot={shot}", "--window-size=1200,3000")
    assert shot.stat().st_size > 20_000
    pixels = mpimg.imread(shot)
    assert pixels.shape[:2] == (3000, 1200)
    assert float(np.std(pixels[..., :3])) > 0.02, "the screenshot is (nearly) a single colour"

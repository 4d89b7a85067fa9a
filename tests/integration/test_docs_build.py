"""The docs site builds with ``mkdocs build --strict``: a broken link, a missing anchor, a page left out of the nav or
any other warning fails it (the site's config, ``mkdocs.yml``, sets the validation to warn and ``--strict`` turns
warnings into errors)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration]

ROOT = Path(__file__).parents[2]


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None,
                    reason="mkdocs and mkdocs-material are not installed (the `docs` extra: pip install -e '.[docs]')")
def test_the_docs_site_builds_strictly(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
                           "--site-dir", str(tmp_path / "site")], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert "WARNING" not in proc.stderr, proc.stderr[-6000:]
    assert (tmp_path / "site" / "reference" / "config" / "index.html").exists()
    # a fence the Markdown extensions did not take renders as a paragraph, and the page after it as code
    unrendered = [str(p.relative_to(tmp_path / "site")) for p in (tmp_path / "site").rglob("*.html")
                  if "<p>```" in p.read_text(errors="replace")]
    assert not unrendered, f"pages with a fence left as text (an option superfences refuses?): {unrendered}"

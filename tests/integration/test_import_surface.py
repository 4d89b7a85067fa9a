"""``import asyncrl`` in a fresh interpreter imports neither ``workers`` nor ``datapipes`` (worker processes stay
light); a public name that lives there is loaded on first access."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

PROBE = ("import sys, asyncrl; layers = lambda: sorted({m.split('.')[0] for m in sys.modules} & "
         "{'workers', 'datapipes'}); print(layers()); asyncrl.RolloutLoader; print(layers())")


def test_import_asyncrl_imports_neither_workers_nor_datapipes():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, timeout=300)
    before, after = out.stdout.splitlines()
    assert before == "[]", out.stdout
    assert "datapipes" in after  # RolloutLoader, loaded when asked for

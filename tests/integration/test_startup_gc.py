"""The start-up garbage collection of the entry points (asyncrl._gc): the collector comes back on with the imports'
heap frozen, and a cold worker imports its engine's modules before that (workers.prestart.preload)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import workers.prestart as prestart

pytestmark = pytest.mark.integration  # real processes or sockets (tests/unit opens none)

ROOT = Path(__file__).parents[2]


def test_freeze_import_heap_freezes_and_re_enables_the_collector():
    code = ("import gc; gc.disable(); import json, email.parser; from asyncrl._gc import freeze_import_heap; "
            "freeze_import_heap(); print(gc.isenabled(), gc.get_freeze_count() > 1000)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "True"]


def test_the_exit_sweeps_the_frozen_heap_so_nothing_is_reported_leaked():
    # frozen and never unfrozen, triton's import-time nanobind objects outlive finalization and every exit prints
    # "nanobind: leaked N instances! ... likely caused by a reference counting issue"
    pytest.importorskip("triton")
    code = "import gc; gc.disable(); import triton.language; from asyncrl._gc import freeze_import_heap; freeze_import_heap()"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0 and "leaked" not in out.stderr, out.stderr[-2000:]


def test_a_cold_worker_preloads_the_engine_its_config_names(monkeypatch):
    seen = []
    monkeypatch.setattr(prestart, "_import", seen.append)
    config = json.dumps({"worker": {"engine": {"type": "hf"}}, "transport": {}})
    prestart.preload(["--worker-id", "w-0", "--config-json", config, "--connect", "tcp://127.0.0.1:1"])
    prestart.preload(["--config-json", "{not json"])  # the worker's own parsing reports it; nothing preloaded here
    prestart.preload(["--connect", "tcp://127.0.0.1:1"])
    assert seen == ["hf", "fake", "fake"]


def test_a_cold_python_m_workers_reaches_the_cli():
    # a cold start (no --await-argv) through workers/__main__.py: preload, freeze, then the CLI (here: its usage error)
    out = subprocess.run([sys.executable, "-m", "workers", "--config-json", "{}"], capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert out.returncode == 2 and "one of --connect ADDR" in out.stderr, out.stderr[-2000:]

"""recipes/drop_in.py with the library's guard, checkpoints and PolicySync: SIGKILLed two steps after a
checkpoint, restarted with --resume, it trains every prompt of the epoch exactly once across the two runs
(the consumed records of the rolled-back steps are dropped on resume, the loader's state re-delivers them)."""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).parents[2]
PROMPTS, GROUP, STEPS = 64, 4, 8  # batch_size 8 groups: one epoch is 8 steps


def _drop_in(run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, str(ROOT / "recipes" / "drop_in.py"), "--run-dir", str(run_dir), "--steps", str(STEPS),
            "--prompts", str(PROMPTS), "--group-size", str(GROUP), "--checkpoint-every", "3", *extra]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)


def test_drop_in_killed_after_a_checkpoint_resumes_exactly_once(tmp_path):
    run = tmp_path / "run"
    first = _drop_in(run, "--kill-after-step", "5")
    assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
    assert first.stdout.count("step ") == 5
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-000003"
    second = _drop_in(run, "--resume")
    assert second.returncode == 0, second.stderr[-3000:]
    assert [line.split(":")[0] for line in second.stdout.splitlines() if line.startswith("step ")] == [
        f"step {s}" for s in range(4, STEPS + 1)]
    rows = [json.loads(line) for line in (run / "consumed.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # steps 4 and 5 of the first run were dropped
    counts = collections.Counter(g for r in rows for g in r["group_ids"])
    assert set(counts) == {f"e0-p{i}" for i in range(PROMPTS)}
    assert [g for g, n in counts.items() if n > 1] == []


def test_a_second_drop_in_on_a_held_run_directory_is_refused(tmp_path):
    from asyncrl.checkpoint.run_dir import RunDirLock

    lock = RunDirLock(tmp_path / "run")
    lock.acquire()
    try:
        proc = _drop_in(tmp_path / "run")
    finally:
        lock.release()
    assert proc.returncode != 0 and "is in use by another run" in proc.stderr

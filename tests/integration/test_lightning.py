"""The drop-in proof for PyTorch Lightning: a RolloutLoader as ``train_dataloader`` with ``ModelCheckpoint`` and
``fit(ckpt_path=...)`` trains every group of the epoch exactly once across a SIGKILL and a resume.

Before acknowledged consumption, every resume lost the batch Lightning had prefetched (the loader counted it
consumed when yielded), staleness reached 2 against a bound of 1 (the bound was checked when the batch was
taken; Lightning trains it one step later), and training began at epoch 1 (Lightning's ``iter()`` to check
the loader started epoch 0 and abandoned it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("lightning")

pytestmark = [pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]
DRIVER = [sys.executable, "-m", "tests.integration._lightning_driver"]
PROMPTS, BATCH, STEPS, EVERY = 24, 4, 6, 3  # 6 steps of 4 groups: exactly one epoch


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "trained.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def run(run_dir: Path, *args: str, timeout: float = 240) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([*DRIVER, "--dir", str(run_dir), "--prompts", str(PROMPTS), "--every", str(EVERY), *args],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_lightning_resume_trains_every_group_exactly_once(tmp_path):
    first = run(tmp_path, "--max-steps", "100", "--pause-after", "5")
    deadline = time.monotonic() + 240
    while not any(r["step"] == 5 for r in records(tmp_path)):
        assert first.poll() is None, first.communicate()[0][-4000:]
        assert time.monotonic() < deadline, "the first run did not reach step 5"
        time.sleep(0.2)
    os.kill(first.pid, signal.SIGKILL)  # the run dies after the checkpoint of step 3, with steps 4-5 trained
    first.communicate()
    before = [r for r in records(tmp_path) if r["step"] <= EVERY]  # what the checkpoint of step 3 holds
    (tmp_path / "trained.jsonl").rename(tmp_path / "trained-first.jsonl")

    second = run(tmp_path, "--max-steps", str(STEPS), "--resume")
    out, _ = second.communicate(timeout=240)
    assert second.returncode == 0, out[-4000:]
    after = records(tmp_path)
    assert [r["step"] for r in before] == [1, 2, 3]
    assert [r["step"] for r in after] == [4, 5, 6], "the resumed run continues at step 4"

    trained = [g for r in before + after for g in r["group_ids"]]
    assert all(g.startswith("e0-") for g in trained), "training starts at epoch 0, not 1"
    assert len(trained) == len(set(trained)), "a group was trained twice"
    assert sorted(trained) == sorted(f"e0-p{i}" for i in range(PROMPTS)), "a group was lost (the prefetched batch)"
    for r in before + after:  # staleness at the version the batch is trained at
        assert max(r["version"] - v for v in r["policy_versions"]) <= 1, r


def test_a_prefetching_loop_without_the_knob_is_refused_with_the_fix(tmp_path):
    """The loop of a user who read nothing (default prefetch=0, no RolloutSync, the module calling
    set_policy_version itself) used to lose Lightning's prefetched batch at every checkpoint, silently. The loader
    sees the consumer fetch ahead (two batches before the first update, one before the second) and refuses."""
    proc = run(tmp_path, "--max-steps", str(STEPS), "--own-sync")
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode != 0, "the lossy loop ran to the end"
    assert "fetches 1 batch(es) ahead" in out and "prefetch=1" in out and "RolloutSync" in out, out[-4000:]
    assert [r["step"] for r in records(tmp_path)] == [1, 2], "refused at the second update, before a checkpoint"

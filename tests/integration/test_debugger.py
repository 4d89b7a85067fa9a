"""The RL debugger on the real recipe: each injected worker fault is detected at the step where it
starts, its batch is dumped, and ``asyncrl replay`` on the dump names the cause. (The healthy run, on
which no detector may fire, is the learning run of test_recipe.py.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from asyncrl.debug.record import read_records
from asyncrl.debug.replay import replay
from tests.integration.test_recipe import EXACT, ROOT, SMALL, _finish, _torchrun

pytestmark = [pytest.mark.integration, pytest.mark.slow]

FROM_VERSION = 4  # the fault starts with policy version 4; steps 1-4 are healthy history for the detectors
# fault -> (the detector that must fire first, the cause replay must name)
FAULTS = {
    "stale_weights": ("logprob_mismatch", "stale_weights"),
    "shift_logprobs": ("logprob_mismatch", "shifted_alignment"),
    "nan_logprobs": ("rejected_rollouts", "rejected_at_gate"),
    "exploding_reward": ("reward_shift", "reward_outlier"),
}


def _anomalies(run):
    path = run / "debug" / "anomalies.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.parametrize("fault", list(FAULTS))
def test_fault_is_detected_where_it_starts_and_replay_names_the_cause(tmp_path, fault):
    detector, cause = FAULTS[fault]
    run = tmp_path / "run"
    fraction = 0.5 if fault == "nan_logprobs" else 1.0  # rejected groups must be able to pass on re-lease
    _finish(_torchrun(run, *EXACT, *SMALL, "train.steps=6", "checkpoint.every=1", "checkpoint.keep=10",
                      f"testing.worker_fault.kind={fault}", f"testing.worker_fault.from_version={FROM_VERSION}",
                      f"testing.worker_fault.fraction={fraction}", nproc=1))
    records = read_records(run / "debug" / "steps-rank0.jsonl")
    assert [r["step"] for r in records] == list(range(1, 7))
    # where it starts: the first step that consumes rollouts of the faulty version (rejected ones never
    # arrive, so for them: the first step that waits for that version's rollouts)
    if fault == "nan_logprobs":
        start = next(r["step"] for r in records if r["policy_version"] >= FROM_VERSION)
    else:
        start = next(r["step"] for r in records if r["rollout_versions"]["max"] >= FROM_VERSION)
    anomalies = _anomalies(run)
    assert anomalies, f"{fault}: no detector fired"
    assert min(a["step"] for a in anomalies) == start, f"{fault}: anomalies before the fault: {anomalies[:3]}"
    assert detector in {a["kind"] for a in anomalies if a["step"] == start}, anomalies
    dump = run / next(a["dump"] for a in anomalies if a["step"] == start)
    assert dump.exists()

    report = replay(dump, run / "checkpoints" / f"step-{start - 1:06d}")
    assert report["cause"] == cause, report["explanation"]
    assert report.get("checkpoint_reproduces_trainer", 0.0) < 1e-5  # the checkpoint is the trainer's weights
    if fault == "stale_weights":
        assert report["matched"]["version"] == FROM_VERSION - 1  # generated with the previous version's weights
        assert report["first_mismatch"]["stamped_version"] == FROM_VERSION
    if fault == "shift_logprobs":
        assert report["shift"] == 1 and report["first_mismatch"]["first_mismatch"] <= 1
    if fault == "nan_logprobs":
        assert any("non-finite rollout logprobs" in e for e in report["errors"])
        # the refused rollouts themselves are in the dump: NaN in the middle of the response, as injected
        assert report["refused"] and all(r["nonfinite_positions"] == [r["tokens"] // 2] for r in report["refused"])
    if fault == "stale_weights":  # and the command line says the same (one fault: the CLI is the same code path)
        out = subprocess.run([sys.executable, "-m", "asyncrl.cli", "replay", str(dump), "--checkpoint",
                              str(run / "checkpoints" / f"step-{start - 1:06d}")], capture_output=True, text=True,
                             env={"HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        assert f"CAUSE: {cause}" in out.stdout

"""The RL debugger on the real recipe: each injected worker fault is detected at the step where it
starts, its batch is dumped, and ``asyncrl replay`` on the dump names the cause. One torchrun launch injects the
faults in turn (``testing.worker_fault.then``); each test reads its fault's window. (The healthy run, on which no
detector may fire, is the learning run of test_recipe.py.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from asyncrl.debug.record import read_records
from asyncrl.debug.replay import replay
from tests.integration.test_recipe import EXACT, ROOT, SMALL, _finish, _torchrun

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# One launch injects the four faults in turn, each in a window of one policy version, healthy versions before and
# between them: the detectors face each fault on healthy history, as in a run with that fault alone (on-policy, so
# version v's rollouts are step v+1's batch). exploding_reward goes first: reward_shift needs min_history (3)
# healthy steps. stale_weights goes last: the updates it skips are never loaded.
# fault -> (its version, the detector that must fire first, the cause replay must name)
FAULTS = {
    "exploding_reward": (4, "reward_shift", "reward_outlier"),
    "shift_logprobs": (6, "logprob_mismatch", "shifted_alignment"),
    "nan_logprobs": (8, "rejected_rollouts", "rejected_at_gate"),
    "stale_weights": (10, "logprob_mismatch", "stale_weights"),
}
STEPS = 12  # two steps of the last fault, as each fault had in a run of its own


def _anomalies(run):
    path = run / "debug" / "anomalies.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _fault_overrides() -> list[str]:
    out, key = [], "testing.worker_fault"
    for i, (fault, (version, _, _)) in enumerate(FAULTS.items()):
        fraction = 0.5 if fault == "nan_logprobs" else 1.0  # rejected groups must be able to pass on re-lease
        out += [f"{key}.kind={fault}", f"{key}.from_version={version}", f"{key}.fraction={fraction}"]
        if i < len(FAULTS) - 1:
            out.append(f"{key}.until_version={version + 1}")
            key += ".then"
    return out


def _start(records: list[dict], fault: str) -> int:
    """Where a fault starts: the first step that consumes rollouts of its version (rejected ones never arrive, so for
    them: the first step that waits for that version's rollouts)."""
    version = FAULTS[fault][0]
    if fault == "nan_logprobs":
        return next(r["step"] for r in records if r["policy_version"] >= version)
    return next(r["step"] for r in records if r["rollout_versions"]["max"] >= version)


@pytest.fixture(scope="module")
def faulty_run(tmp_path_factory):
    """One recipe run (one rank) with every fault of FAULTS injected in turn, a checkpoint every step."""
    run = tmp_path_factory.mktemp("debugger") / "run"
    _finish(_torchrun(run, *EXACT, *SMALL, f"train.steps={STEPS}", "checkpoint.every=1",
                      f"checkpoint.keep={STEPS + 1}", *_fault_overrides(), nproc=1))
    return run


@pytest.mark.parametrize("fault", list(FAULTS))
def test_fault_is_detected_where_it_starts_and_replay_names_the_cause(faulty_run, fault):
    version, detector, cause = FAULTS[fault]
    run = faulty_run
    records = read_records(run / "debug" / "steps-rank0.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    starts = {f: _start(records, f) for f in FAULTS}
    start = starts[fault]
    # this fault's anomalies: those after the previous fault's start (the healthy steps between included)
    previous = [starts[f] for f in FAULTS if FAULTS[f][0] < version]
    anomalies = [a for a in _anomalies(run) if a["step"] > max(previous, default=0)]
    assert anomalies, f"{fault}: no detector fired"
    assert min(a["step"] for a in anomalies) == start, f"{fault}: anomalies before the fault: {anomalies[:3]}"
    assert detector in {a["kind"] for a in anomalies if a["step"] == start}, anomalies
    dump = run / next(a["dump"] for a in anomalies if a["step"] == start)
    assert dump.exists()

    report = replay(dump, run / "checkpoints" / f"step-{start - 1:06d}")
    assert report["cause"] == cause, report["explanation"]
    assert report.get("checkpoint_reproduces_trainer", 0.0) < 1e-5  # the checkpoint is the trainer's weights
    if fault == "stale_weights":
        assert report["matched"]["version"] == version - 1  # generated with the previous version's weights
        assert report["first_mismatch"]["stamped_version"] == version
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

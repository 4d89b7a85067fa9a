"""A rolled-back timeline is never trained on (issue 10, break 1), with real processes.

A trainer incarnation checkpoints at version 3, goes on to version 6 and is SIGKILLed; a worker started
elsewhere (it outlives the trainer) holds that dead incarnation's version 6. A new incarnation resumes from
the checkpoint at version 3 and reuses versions 4, 5, 6 for other weights. Before timelines the worker
ignored the resumed trainer's version 3 (older than its 6) and whole batches stamped v6 were consumed at
staleness -3. Now the worker replaces its weights with the live incarnation's, and the pool refuses anything
newer than the trainer or from the dead incarnation, so every batch is trained at staleness 0..max_staleness.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]
DRIVER = [sys.executable, "-m", "tests.integration._timeline_driver"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, what: str, procs: list[subprocess.Popen], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        for p in procs:
            assert p.poll() is None, f"process {p.args} exited with {p.returncode} while waiting for {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def committed_version(weights_dir: Path) -> int | None:
    try:
        return json.loads((weights_dir / "committed-rollback-worker.json").read_text())["version"]
    except (OSError, ValueError, KeyError):
        return None


def test_resumed_trainer_never_trains_the_dead_timeline(tmp_path):
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    args = ["--dir", str(tmp_path), "--port", str(port)]
    weights_dir = tmp_path / "weights"
    first = subprocess.Popen([*DRIVER, "first", *args], cwd=ROOT, env=env)
    worker = None
    try:
        wait_for(lambda: (weights_dir / "latest.json").exists(), "the first incarnation's weights", [first])
        worker = subprocess.Popen(
            [sys.executable, "-m", "asyncrl.cli", "worker", "--connect", f"tcp://127.0.0.1:{port}",
             "--worker-id", "rollback-worker", "--set", "worker.weights.type=shm",
             "--set", f"worker.weights.address={weights_dir}", "--set", "worker.slots=4", "--set", "worker.max_batch=2",
             "--set", "worker.engine.max_new_tokens=6", "--set", "transport.peer_timeout_s=60",
             "--set", "transport.heartbeat_s=0.2"],
            cwd=ROOT, env=env)
        wait_for(lambda: (tmp_path / "first.json").exists(), "the first incarnation to reach version 6", [first, worker])
        wait_for(lambda: committed_version(weights_dir) == 6, "the worker to run the dead version 6", [first, worker])
        os.kill(first.pid, signal.SIGKILL)
        first.wait()

        resume = subprocess.run([*DRIVER, "resume", *args], cwd=ROOT, env=env, timeout=240)
        assert resume.returncode == 0
        result = json.loads((tmp_path / "resume.json").read_text())
        worker.wait(timeout=60)  # the resumed trainer's SHUTDOWN
    finally:
        for p in (first, worker):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()

    dead = json.loads((tmp_path / "first.json").read_text())["incarnation"]
    assert dead != result["incarnation"]
    assert result["batches"], "the resumed run trained nothing"
    for b in result["batches"]:
        lags = [b["version"] - v for v in b["policy_versions"]]
        assert min(lags) >= 0, f"trained a rollout newer than the trainer (dead timeline): {b}"
        assert max(lags) <= 1, f"staleness bound violated: {b}"
    trained = [g for b in result["batches"] for g in b["group_ids"]]
    assert len(trained) == len(set(trained)) == 48 - 3 * 4, "the resumed run trains the rest of the epoch once"
    assert all(g.startswith("e0-") for g in trained)
    # whatever the worker still had in flight from the dead incarnation was refused (counted), never trained
    pool = result["stats"]["pool"]
    print("refused:", {k: pool.get(k, 0) for k in ("dead_timeline", "ahead_of_trainer")})

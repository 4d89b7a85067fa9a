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


@pytest.mark.parametrize("streaming", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_resumed_trainer_never_trains_the_dead_timeline(tmp_path, streaming):
    """Streaming: the resumed incarnation's weights land while the worker's requests are in flight; groups of the
    dead incarnation are not sent but generated again."""
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
             "--set", f"worker.streaming={'true' if streaming else 'false'}",
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


def test_a_dead_incarnations_rollouts_are_refused_over_the_wire():
    """The pool's own check, end to end through real sockets: a worker holding real leases of the resumed
    run answers them with rollouts stamped by the dead incarnation at a version past the fork (as one that
    loaded the dead run's last weights would); every one is refused and regenerated, none trained."""
    import threading

    import torch

    from asyncrl import LoaderConfig, RolloutLoader, TransportConfig
    from asyncrl.transport import setup_rollout_sender
    from tests.unit.pool.test_pool import make_group

    DEAD_REWARD = -0.75

    transport = TransportConfig(heartbeat_s=0.2, peer_timeout_s=10.0)
    config = LoaderConfig(group_size=2, batch_size=2, capacity=8, max_staleness=2, num_workers=0, wait_timeout_s=60,
                          poll_timeout_s=0.2, transport=transport)
    prompts = [{"prompt_ids": [i + 1, 2]} for i in range(12)]
    with RolloutLoader(prompts, config, incarnation="dead") as dead:
        dead.set_policy_version(3)
        state = dead.state_dict()  # the checkpoint the resumed run loads (version 3)
    loader = RolloutLoader(prompts, config, incarnation="live")
    loader.load_state_dict(state)
    stop = threading.Event()
    sent = {"dead": 0, "live": 0}

    def worker() -> None:  # past the fork, answers each lease first as the dead run's, then as the live run's
        sender = setup_rollout_sender(transport, [loader.endpoint], worker_id="w-dead", slots=4)
        sender.start()
        try:
            while not stop.is_set() and not sender.done:
                for lease in sender.take_leases(4, timeout=0.2):
                    for incarnation in ("dead", "live") if lease.policy_version > 3 else ("live",):
                        group = make_group(lease.epoch, lease.prompt_index, lease.group_size, lease.policy_version,
                                           worker_id="w-dead")
                        for r in group.rollouts:
                            r.incarnation = incarnation
                            if incarnation == "dead":
                                r.reward = DEAD_REWARD  # recognisable if it were ever trained
                        sender.send_group(lease, group)
                        sent[incarnation] += 1
        finally:
            sender.close()

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    try:
        it = iter(loader)  # loads the state (version 3) and fetches the first batch
        first = next(it)
        loader.set_policy_version(4)
        loader.set_policy_version(5)  # the resumed run reaches version 5 again: its own, not the dead run's
        batches = [next(it) for _ in range(3)]
        stop.set()
        thread.join(timeout=20)  # the worker's sender flushes what it sent before it closes
        deadline = time.monotonic() + 10
        while loader.stats()["pool"].get("dead_timeline", 0) < 2 * sent["dead"] and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = loader.stats()
    finally:
        stop.set()
        loader.close()
        thread.join(timeout=20)
    assert torch.equal(first["policy_versions"], torch.full_like(first["policy_versions"], 3))
    assert sent["dead"] >= 1  # leases granted past the fork were answered by the dead incarnation first
    assert stats["pool"].get("dead_timeline", 0) == 2 * sent["dead"], stats["pool"]  # every one refused
    for b in [first, *batches]:  # only the live run's rollouts were trained
        assert not (b["rewards"] == DEAD_REWARD).any(), b["group_ids"]
        assert int(b["policy_versions"].max()) <= 5

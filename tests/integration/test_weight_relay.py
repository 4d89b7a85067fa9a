"""Per-node weight relays across real processes: one copy per node, verified end to end, and relays that die.

Simulated nodes: each node is a relay process with its own relay directory under ``/dev/shm`` and a process hosting
that node's workers (``benchmarks/_relay_node.py``: one receiver per worker, opened as ``run_worker`` opens it, with
``weights.relay``). The broadcaster lives in the test process. A relay killed mid-transfer is the real relay, slowed
down for one version by ``_relay_driver.py`` so the kill lands inside it.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

from asyncrl.config import RelayConfig, TransportConfig
from asyncrl.weights import ZmqWeightBroadcaster
from asyncrl.weights import _relay_dir as rd
from benchmarks._relay_node import crc
from workers.relay import RelayLauncher

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
WORKERS_DRIVER = ROOT / "benchmarks" / "_relay_node.py"
TIMEOUT_S = 60.0
MB = 1 << 20


def model(version: int, mb: int = 4) -> dict[str, torch.Tensor]:
    """``mb`` MiB of float32 in 64 KiB tensors (many buckets of 1 MiB), different for every version."""
    g = torch.Generator().manual_seed(version)
    return {f"layers.{i}.weight": torch.randn(128, 128, generator=g) for i in range(mb * 16)}


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.nbytes for t in tensors.values())


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


class Workers:
    """The node's worker process; a reader thread queues its events."""

    def __init__(self, relay: Path, address: str, ids: list[str], log: Path, *extra: str):
        argv = [sys.executable, str(WORKERS_DRIVER), "--relay", str(relay), "--address", address, "--ids", ",".join(ids),
                "--crc", *extra]
        self.log, self.ids = log, ids
        with open(log, "w") as err:
            self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True, env=env())
        self.lines: queue.Queue[str] = queue.Queue()
        self.committed: dict[str, dict[int, dict]] = {w: {} for w in ids}
        self.paths: dict[str, str | None] = {w: None for w in ids}
        self.relay_bytes: dict[str, int] = {w: 0 for w in ids}
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put("")

    def pump(self, until: float) -> None:
        try:
            line = self.lines.get(timeout=max(0.0, min(0.05, until - time.monotonic())))
        except queue.Empty:
            return
        if not line:
            raise AssertionError(f"workers exited {self.proc.wait()}: {self.log.read_text()[-3000:]}")
        e = json.loads(line)
        if e["event"] == "committed":
            self.committed[e["worker"]][e["version"]] = e
        elif e["event"] == "path":
            self.paths[e["worker"]] = e["path"]
        elif e["event"] == "relay_bytes":
            self.relay_bytes[e["worker"]] = e["bytes"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def wait_until(check, what: str, nodes: list[Workers], timeout: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            for n in nodes:
                if n.proc.poll() is None:
                    os.kill(n.proc.pid, signal.SIGUSR1)  # its threads' stacks, into its log
            time.sleep(0.3)
            logs = "\n".join(n.log.read_text()[-2000:] for n in nodes)
            raise AssertionError(f"timed out waiting for {what}; paths {[n.paths for n in nodes]}; logs:\n{logs}")
        for n in nodes:
            n.pump(deadline)


def relay_argv(address: str, directory: Path, relay_id: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "asyncrl.cli", "relay", "--connect", address, "--serve-shm", str(directory),
            "--relay-id", relay_id, "--no-supervise", "--log-level", "INFO", *extra]


def wait_relay_up(directory: Path, proc: subprocess.Popen | None = None, log: Path | None = None) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not rd.look(directory).up:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"relay exited {proc.returncode}: {log.read_text()[-3000:] if log else ''}")
        assert time.monotonic() < deadline, f"relay of {directory} never came up"
        time.sleep(0.05)


@pytest.fixture
def shm_root():
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory(prefix="asyncrl-relay-test-", dir=base) as d:
        yield Path(d)


def end(started: list[subprocess.Popen]) -> None:
    """Ends the processes a test started, by pid, the last started first (the workers before their relays):
    SIGTERM, then SIGKILL."""
    for p in reversed(started):
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


@pytest.fixture
def procs():
    """Processes a test started (the test ends them before closing its broadcaster; this is the safety net)."""
    started: list[subprocess.Popen] = []
    yield started
    end(started)


def start_nodes(n_nodes: int, address: str, shm_root: Path, tmp_path: Path, procs: list, *relay_extra: str,
                worker_extra: tuple[str, ...] = ()) -> list[Workers]:
    relays = []
    for k in range(n_nodes):  # the relays first: a worker that finds no relay starts on the direct path
        log = tmp_path / f"relay-{k}.log"
        with open(log, "w") as err:
            p = subprocess.Popen(relay_argv(address, shm_root / f"node{k}", f"relay-{k}", *relay_extra),
                                 stderr=err, stdout=subprocess.DEVNULL, env=env())
        procs.append(p)
        relays.append((p, log))
    for k, (p, log) in enumerate(relays):
        wait_relay_up(shm_root / f"node{k}", p, log)
    nodes = []
    for k in range(n_nodes):
        w = Workers(shm_root / f"node{k}", address, [f"n{k}w0", f"n{k}w1"], tmp_path / f"workers-{k}.log",
                    *worker_extra)
        procs.append(w.proc)
        nodes.append(w)
    return nodes


def all_hold(nodes: list[Workers], version: int) -> bool:
    return all(version in n.committed[w] for n in nodes for w in n.ids)


def sparse_step(base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The next version of ``base`` after a sparse step: a few words of one tensor in eight change."""
    step = {k: v.clone() for k, v in base.items()}
    for t in list(step.values())[::8]:
        t[0, :4] += 1.0
    return step


@pytest.mark.parametrize("n_nodes,delta", [
    (2, True),
    # the same proof at 4 nodes (the fan-out benchmark measures 4 nodes' bytes in every run): 8 processes
    pytest.param(4, False, marks=[pytest.mark.slow, pytest.mark.extended]),
])
def test_one_copy_per_node_and_every_worker_holds_the_verified_version(n_nodes, delta, shm_root, tmp_path, procs):
    """Version 1 crosses once per node in full (no base yet); version 2 once per node, as a delta with ``delta``.
    Every worker holds exactly what was published, read from its node's relay, never from the broadcaster."""
    b = ZmqWeightBroadcaster(bucket_bytes=MB, delta=delta)
    try:
        versions = {1: model(1)}
        versions[2] = sparse_step(versions[1]) if delta else model(2)
        b.publish(versions[1], 1)
        nodes = start_nodes(n_nodes, b.address, shm_root, tmp_path, procs,
                            *(("--set", "relay.delta=true") if delta else ()))
        wait_until(lambda: all_hold(nodes, 1), "every worker to hold version 1", nodes)
        first = b.stats()
        b.publish(versions[2], 2)
        wait_until(lambda: all_hold(nodes, 2), "every worker to hold version 2", nodes)
        second = b.stats()
        size = nbytes(versions[1])
        assert first["bytes_served"] == n_nodes * size  # one full copy per node, not per worker
        sent = second["bytes_served"] - first["bytes_served"]
        if delta:  # one delta per node, every bucket of it: nothing in full
            n_buckets = len(versions[2]) // 16
            assert second.get("buckets_delta", 0) - first.get("buckets_delta", 0) == n_nodes * n_buckets
            assert sent == second["delta_bytes"] - first.get("delta_bytes", 0) and 0 < sent < n_nodes * size // 8
        else:
            assert sent == n_nodes * size
        for n in nodes:
            for w in n.ids:
                for v in (1, 2):
                    e = n.committed[w][v]
                    assert e["via"] == "relay" and e["crc"] == crc(versions[v]), (w, v, e)
        # the broadcaster saw the relays only, each committing the version it re-served
        assert b.committed() == {f"relay-{k}": 2 for k in range(n_nodes)}
        assert sorted(b.stats()["receivers"]) == [f"relay-{k}" for k in range(n_nodes)]
    finally:
        end(procs)
        b.close()


def committed_records(directory: Path) -> dict[str, int]:
    out = {}
    for path in directory.glob("committed-*.json"):
        record = json.loads(path.read_text())
        out[record["receiver_id"]] = record["version"]
    return out


def slowed_relay(address: str, directory: Path, tmp_path: Path, where: str, procs: list) -> tuple[subprocess.Popen, Path]:
    events = tmp_path / f"slow-{where}.jsonl"
    spec = {"version": 2, "where": where, "delay": 0.05, "events": str(events)}
    argv = [sys.executable, str(Path(__file__).with_name("_relay_driver.py")), "--relay-id", "relay-0",
            "--config-json", json.dumps({"relay": {"connect": address, "directory": str(directory)}}),
            "--log-level", "INFO"]
    log = tmp_path / "relay.log"
    with open(log, "w") as err:
        p = subprocess.Popen(argv, stderr=err, stdout=subprocess.DEVNULL,
                             env={**env(), "ASYNCRL_TEST_RELAY_SLOW": json.dumps(spec)})
    procs.append(p)
    wait_relay_up(directory, p, log)
    return p, events


def buckets_noted(events: Path) -> int:
    return len(events.read_text().splitlines()) if events.exists() else 0


def test_a_relay_killed_mid_write_commits_nothing_and_the_workers_still_get_the_next_version(shm_root, tmp_path,
                                                                                               procs):
    """Killed while it writes version 2 into the node's segment (downstream), with the workers verifying the buckets
    already written: no worker stages or commits the relay's version 2, the relay never commits it upstream, and
    the workers go on through the direct path (version 2 from the broadcaster, then version 3)."""
    b = ZmqWeightBroadcaster(bucket_bytes=MB)
    directory = shm_root / "node0"
    try:
        versions = {v: model(v, mb=16) for v in (1, 2, 3)}
        b.publish(versions[1], 1)
        relay, events = slowed_relay(b.address, directory, tmp_path, "fill", procs)
        node = Workers(directory, b.address, ["w0", "w1"], tmp_path / "workers.log")
        procs.append(node.proc)
        wait_until(lambda: all_hold([node], 1), "version 1 through the relay", [node])
        b.publish(versions[2], 2)
        wait_until(lambda: buckets_noted(events) >= 4 and all(n >= 18 * MB for n in node.relay_bytes.values()),
                   "the relay to write, and the workers to verify, part of version 2", [node])
        os.kill(relay.pid, signal.SIGKILL)
        relay.wait()
        assert buckets_noted(events) < 16  # mid-transfer: the segment holds part of version 2
        wait_until(lambda: all(p == "direct" for p in node.paths.values()), "the fallback", [node])
        assert b.committed().get("relay-0") == 1  # the relay committed nothing of version 2
        assert max(committed_records(directory).values()) == 1  # no worker committed it to the relay
        wait_until(lambda: all_hold([node], 2), "version 2 through the direct path", [node])
        b.publish(versions[3], 3)
        wait_until(lambda: all_hold([node], 3), "version 3 with the relay dead", [node])
        for w in node.ids:
            assert [node.committed[w][v]["via"] for v in (1, 2, 3)] == ["relay", "direct", "direct"]
            assert all(node.committed[w][v]["crc"] == crc(versions[v]) for v in (1, 2, 3))
        assert max(committed_records(directory).values()) == 1
    finally:
        end(procs)
        b.close()


class DriverLauncher(RelayLauncher):
    """The supervisor, replacing the slowed-down relay of ``_relay_driver.py`` (with ``once``: the replacement is not
    slowed)."""

    module = "tests.integration._relay_driver"


def test_a_relay_killed_mid_receive_is_replaced_and_its_workers_return_to_it(shm_root, tmp_path):
    """Killed while version 2 arrives from the broadcaster (upstream): nothing of it was re-served; the supervisor
    replaces the relay, the workers get the versions meanwhile from the broadcaster and return to the replacement."""
    b = ZmqWeightBroadcaster(bucket_bytes=MB)
    directory = shm_root / "node0"
    events = tmp_path / "slow-receive.jsonl"
    spec = {"version": 2, "where": "receive", "delay": 0.05, "events": str(events), "once": str(tmp_path / "slowed")}
    launcher = DriverLauncher(RelayConfig(connect=b.address, directory=str(directory), backoff_s=0.2),
                              TransportConfig(), relay_id="relay-0",
                              env={"PYTHONPATH": str(ROOT), "ASYNCRL_TEST_RELAY_SLOW": json.dumps(spec)})
    node = None
    try:
        versions = {v: model(v, mb=16) for v in (1, 2, 3)}
        b.publish(versions[1], 1)
        launcher.start()
        wait_relay_up(directory)
        first_pid = launcher.pids[0]
        node = Workers(directory, b.address, ["w0", "w1"], tmp_path / "workers.log")
        wait_until(lambda: all_hold([node], 1), "version 1 through the relay", [node])
        b.publish(versions[2], 2)
        wait_until(lambda: buckets_noted(events) >= 4, "the relay to receive part of version 2", [node])
        launcher.kill(0)  # not replaced before the next poll(): first, what the dead relay left
        assert buckets_noted(events) < 16
        wait_until(lambda: all(p == "direct" for p in node.paths.values()), "the fallback", [node])
        wait_until(lambda: all_hold([node], 2), "version 2 through the direct path", [node])
        assert b.committed().get("relay-0") == 1  # nothing of version 2 committed by the killed relay
        assert all(node.committed[w][2]["via"] == "direct" for w in node.ids)
        deadline = time.monotonic() + TIMEOUT_S
        while launcher.pids[0] in (None, first_pid):  # the supervisor notices the death and replaces it
            launcher.poll()
            node.pump(deadline)
            assert time.monotonic() < deadline, "the relay was not replaced"
        b.publish(versions[3], 3)
        wait_until(lambda: all_hold([node], 3), "version 3", [node])
        wait_until(lambda: all(p == "relay" for p in node.paths.values()), "the workers back on the relay", [node])
        assert launcher.stats()["restarts"] == [1]
        for w in node.ids:
            assert all(node.committed[w][v]["crc"] == crc(versions[v]) for v in (1, 2, 3))
        assert b.committed().get("relay-0") == 3
    finally:
        if node is not None:
            node.stop()
        launcher.shutdown()
        b.close()


def worker_statuses(loader, key: str, want, timeout: float = TIMEOUT_S) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        workers = loader.stats()["transport"]["workers"]
        if len(workers) == 2 and all(want(w.get(key)) for w in workers.values()):
            return workers
        time.sleep(0.1)
    raise AssertionError(f"worker status {key} never satisfied: {loader.stats()['transport']['workers']}")


def test_real_workers_behind_a_supervised_relay(shm_root, tmp_path):
    """``asyncrl relay`` (supervised) on the node, two real rollout workers (``weights.relay``) feeding a loader: the
    weights reach them through the relay (one copy per version leaves the broadcaster) and rollouts carry the
    version; the relay process killed, the supervisor replaces it and the workers return to it."""
    from asyncrl import FakeEngineConfig, LoaderConfig, RolloutLoader, WorkerConfig
    from asyncrl.config import WeightSyncConfig

    directory = shm_root / "node0"
    weights = {name: torch.arange(256 * 1024, dtype=torch.float32) for name in "abcd"}  # 4 MiB
    b = ZmqWeightBroadcaster(bucket_bytes=MB)
    b.publish(weights, 0)
    log = tmp_path / "relay.log"
    with open(log, "w") as err:
        supervisor = subprocess.Popen(
            [sys.executable, "-m", "asyncrl.cli", "relay", "--connect", b.address, "--serve-shm", str(directory),
             "--relay-id", "relay-0", "--set", "relay.backoff_s=0.2", "--log-level", "INFO"],
            stderr=err, stdout=subprocess.DEVNULL, env=env())
    config = LoaderConfig(
        group_size=2, batch_size=2, capacity=4, max_staleness=None, num_workers=2, wait_timeout_s=90,
        transport=TransportConfig(heartbeat_s=0.2, peer_timeout_s=30),
        worker=WorkerConfig(engine=FakeEngineConfig(max_new_tokens=8, seconds_per_token=0.002),
                            weights=WeightSyncConfig(type="zmq", address=b.address, relay=str(directory))))
    try:
        wait_relay_up(directory, supervisor, log)
        with RolloutLoader([{"prompt_ids": [i + 1]} for i in range(2000)], config) as loader:
            it = iter(loader)
            assert {int(v) for v in next(it)["policy_versions"]} == {0}
            loader.set_policy_version(1)
            b.publish({k: v + 1 for k, v in weights.items()}, 1)
            worker_statuses(loader, "policy_version", lambda v: v == 1)
            assert all(w["weight_path"] == "relay" for w in loader.stats()["transport"]["workers"].values())
            assert b.stats()["bytes_served"] == 2 * nbytes(weights)  # versions 0 and 1, once each for the node
            assert set(b.stats()["receivers"]) == {"relay-0"}
            relay_pid = rd.look(directory).info["pid"]
            assert relay_pid != supervisor.pid
            os.kill(relay_pid, signal.SIGKILL)  # the relay, not its supervisor
            worker_statuses(loader, "weight_path", lambda p: p in ("direct", "both"))
            loader.set_policy_version(2)
            b.publish({k: v + 2 for k, v in weights.items()}, 2)
            worker_statuses(loader, "policy_version", lambda v: v == 2)
            worker_statuses(loader, "weight_path", lambda p: p == "relay")  # back on the replacement
            assert rd.look(directory).info["pid"] not in (relay_pid, supervisor.pid)
            later = [int(v) for _ in range(6) for v in next(it)["policy_versions"]]
            assert later[-1] == 2 and supervisor.poll() is None
    finally:
        end([supervisor])
        b.close()
    assert supervisor.returncode == 0 and not rd.look(directory).up

"""The Ray actors of a run: the registry, a trainer rank, a rollout worker. Each rank and each worker is a process of
asyncrl's own (the recipe, ``asyncrl worker``) started by its actor and tied to it: it exits as soon as the actor's
process is gone (:mod:`asyncrl.lifeline`), so a killed actor, a removed node or a killed supervisor leaves nothing
training or generating.

Ray's channel pickles and is unauthenticated: run the Ray network privately. What crosses it here: the pools' records
(public keys, endpoints), worker public keys, the run's config (with the pools' key pair, to the trainer ranks only).
A worker's secret key is made in its actor and never leaves that node.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import ray
import yaml

from asyncrl._owned_dir import OwnedDir, make_owned_dir
from asyncrl.cluster.registry import complete_records, pool_record_path, write_allow_list
from asyncrl.codec import dumps_json, loads_json

__all__ = ["Registry", "RegistryActor", "RolloutWorker", "RolloutWorkerActor", "TrainerRank", "TrainerRankActor"]


def _node() -> dict[str, Any]:
    return {"node_id": ray.get_runtime_context().get_node_id(), "node_ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(), "host": socket.gethostname()}


RANK_DIR_PREFIX, WORKER_DIR_PREFIX = "asyncrl-ray-rank-", "asyncrl-ray-worker-"


def _private_dir(prefix: str) -> OwnedDir:
    """A 0700 scratch directory for an actor's secrets and files (a rank's run file with the pools' key pair, its
    allow-list; a worker's key pair and pool records), removed when the actor is done with it; one left by an actor
    Ray killed (its owner lock free) is swept by the next actor that makes one on this host (:mod:`asyncrl._owned_dir`).
    """
    owned, _ = make_owned_dir(prefix)
    return owned


def _stop(proc: subprocess.Popen | None, timeout_s: float) -> int | None:
    """SIGTERM (the recipe and ``asyncrl worker`` leave cleanly on it), then SIGKILL after ``timeout_s``."""
    if proc is None:
        return None
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


class Registry:
    """The run's named registry (``asyncrl-registry-<run>``): the pools' records, and join requests from workers
    outside Ray (their public keys; the supervisor authorizes them). Threaded (``max_concurrency``): the supervisor
    keeps one :meth:`wait_pending` call parked here instead of polling."""

    def __init__(self) -> None:
        self._records: list[dict[str, Any]] | None = None
        self._join: dict[str, str] = {}
        self._authorized: set[str] = set()
        self._cond = threading.Condition()

    def put_records(self, records: list[dict[str, Any]] | None) -> None:
        with self._cond:
            self._records = records

    def records(self) -> list[dict[str, Any]] | None:
        with self._cond:
            return self._records

    def request_join(self, worker_id: str, public_key: str) -> None:
        with self._cond:
            self._join[worker_id] = public_key
            self._cond.notify_all()

    def _pending(self) -> dict[str, str]:
        """(Under ``_cond``.) The join requests not authorized yet."""
        return {w: k for w, k in self._join.items() if w not in self._authorized}

    def pending(self) -> dict[str, str]:
        with self._cond:
            return self._pending()

    def wait_pending(self, timeout_s: float) -> dict[str, str]:
        """The join requests not authorized yet, once there is one (or after ``timeout_s``, maybe none)."""
        with self._cond:
            return self._cond.wait_for(self._pending, timeout_s) or {}

    def mark_authorized(self, worker_id: str) -> None:
        with self._cond:
            self._authorized.add(worker_id)

    def authorized(self, worker_id: str) -> bool:
        with self._cond:
            return worker_id in self._authorized


class TrainerRank:
    """One trainer rank: the recipe in a child process with torchrun's variables; its pool's allow-list file."""

    def __init__(self, rank: int):
        self.rank = rank
        self._owned = _private_dir(RANK_DIR_PREFIX)
        self.dir = self._owned.path
        self.allow_file = self.dir / "allowed_keys"
        self._lock = threading.Lock()
        write_allow_list(self.allow_file, [])  # nobody until the supervisor authorizes workers
        self.proc: subprocess.Popen | None = None
        self.started = 0.0

    def node(self) -> dict[str, Any]:
        return _node()

    def free_port(self, host: str) -> int:
        """A free TCP port on ``host`` for the rendezvous (rank 0; the same race torchrun's ``--standalone`` has)."""
        with socket.socket() as s:
            s.bind((host, 0))
            return s.getsockname()[1]

    def set_allow_list(self, keys: list[str]) -> None:
        with self._lock:  # calls run in the actor's threads: the last one written wins, never a mix
            write_allow_list(self.allow_file, keys)

    def start(self, tree: dict[str, Any], env: dict[str, str], recipe: str, log: str, pythonpath: list[str]) -> int:
        """Writes the rank's run file (0600: it holds the pools' key pair) and starts the recipe; returns its pid."""
        tree["rollout"].setdefault("transport", {})["curve_allowed_keys_file"] = str(self.allow_file)
        run_file = self.dir / "run.yaml"
        fd = os.open(run_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump(tree, f, sort_keys=False)
        full_env = {**os.environ, **env, "PYTHONPATH": os.pathsep.join([*pythonpath, os.environ.get("PYTHONPATH", "")])}
        Path(log).parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            self.proc = subprocess.Popen([sys.executable, recipe, "--config", str(run_file), "--resume"], env=full_env,
                                         stdout=out, stderr=subprocess.STDOUT)
        self.started = time.time()
        return self.proc.pid

    def wait(self) -> int:
        """Blocks until the recipe exits; its exit status."""
        assert self.proc is not None, "start() first"
        return self.proc.wait()

    def record(self, run_dir: str) -> dict[str, Any] | None:
        """This rank's pool record, once this start of the recipe has written it."""
        path = pool_record_path(run_dir, self.rank)
        try:
            rec = loads_json(path.read_bytes())
        except (OSError, ValueError):
            return None
        return rec if rec.get("written", 0) >= self.started - 1 and rec.get("pid") == getattr(self.proc, "pid", None) else None

    def stop(self, timeout_s: float = 10.0) -> int | None:
        code = _stop(self.proc, timeout_s)
        if getattr(self, "_relay_stop", None) is not None:  # the relay last: its directory goes with it
            self._relay_stop.set()
            self._relay_thread.join(timeout_s)
            shutil.rmtree(self._relay_dir, ignore_errors=True)
        if self.proc is None or self.proc.poll() is not None:  # the recipe is gone: its run file and allow-list too
            self._owned.close()
        return code

    def relay_key(self) -> str:
        """A key pair for this node's weight relay, made here; its public key (the supervisor authorizes it)."""
        from asyncrl.transport.zmq import generate_curve_keys

        public, self._relay_secret = generate_curve_keys()
        return public

    def start_relay(self, connect: str, server_key: str, directory: str, delta: bool) -> str:
        """Weights by locality: this node's relay (:mod:`asyncrl.weights.relay`), in a thread of this actor, fetches
        each version once from the broadcaster over zmq and serves it in shared memory under ``directory`` to the
        workers placed on this node; it ends with the actor (:meth:`stop` removes the directory; the directories of
        this run's earlier gangs, ``<prefix>.<attempt>`` beside ``directory``, killed without a stop, are removed here).
        Returns ``directory``."""
        from asyncrl.config import RelayConfig, TransportConfig
        from workers.relay import run_relay

        prefix = directory.rsplit(".", 1)[0]
        for stale in glob.glob(f"{glob.escape(prefix)}.*"):
            if stale != directory and re.fullmatch(re.escape(prefix) + r"\.\d+", stale):
                shutil.rmtree(stale, ignore_errors=True)
        self._relay_dir = directory

        cfg = RelayConfig(connect=connect, directory=directory, serve="shm", delta=delta)
        transport = TransportConfig(curve_client_secret_key=self._relay_secret)
        self._relay_stop = threading.Event()
        self._relay_thread = threading.Thread(target=run_relay, args=(cfg, transport), daemon=True,
                                              name="asyncrl-relay", kwargs={"relay_id": f"relay-rank{self.rank}",
                                                                            "server_key": server_key,
                                                                            "stop": self._relay_stop})
        self._relay_thread.start()
        return directory


class RolloutWorker:
    """One rollout worker: ``asyncrl worker`` in a child process, its CURVE key pair made here."""

    def __init__(self, worker_id: str):
        from asyncrl.transport.zmq import write_curve_key_file

        self.worker_id = worker_id
        self._owned = _private_dir(WORKER_DIR_PREFIX)
        self.dir = self._owned.path
        self.key_file = self.dir / "worker.key"
        self.public_key = write_curve_key_file(str(self.key_file))  # 0600; only the public key is returned
        self.proc: subprocess.Popen | None = None

    def info(self) -> dict[str, Any]:
        return {**_node(), "worker_id": self.worker_id, "public_key": self.public_key}

    def run(self, records: list[dict[str, Any]], sets: list[str], log: str) -> int:
        """Serves the pools of ``records`` until they shut down (or this actor dies); the worker's exit status."""
        if complete_records(records) is None:
            raise ValueError(f"worker {self.worker_id}: an incomplete set of pool records")
        pools = self.dir / "pools"
        pools.mkdir(exist_ok=True)
        for rec in records:
            (pools / f"rank{rec['rank']}.json").write_bytes(dumps_json(rec))
        argv = [sys.executable, "-m", "asyncrl.cli", "worker", "--registry", str(self.dir), "--client-key-file",
                str(self.key_file), "--worker-id", self.worker_id, "--parent-pid", str(os.getpid()),
                "--registry-timeout-s", "5"]
        for s in sets:
            argv += ["--set", s]
        Path(log).parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        try:
            return self.proc.wait()
        finally:
            self._owned.close()  # its key pair and records; the actor ends next

    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def drain(self, timeout_s: float) -> int | None:
        """Removed on purpose: SIGTERM makes ``asyncrl worker`` say BYE (the pools re-issue its leases at once, no
        timeout, no storm) and flush the groups it finished; killed after ``timeout_s``."""
        return _stop(self.proc, timeout_s)


# the actor classes Ray schedules (the plain classes above stay testable in process)
RegistryActor = ray.remote(Registry)
TrainerRankActor = ray.remote(TrainerRank)
RolloutWorkerActor = ray.remote(RolloutWorker)

"""The node relay process role: one per rollout node, fetching each weight version once for the node's workers.

::

    asyncrl relay --connect tcp://TRAINER:PORT --serve-shm /dev/shm/asyncrl-relay      (the supervisor: RelayLauncher)
        └── python -m workers.relay --parent-pid SUPERVISOR ...                           (the relay: run_relay)
              WeightRelay: broadcaster ══zmq══► verify ──► shm segments ──► this node's workers
                                                                              (worker.weights.relay = the directory)

:func:`run_relay` is the relay process's body (also what a cluster launcher runs in a process of its own, e.g. a Ray
actor): it serves until SIGTERM/SIGINT, until its parent is gone (``parent_pid``), or until its forward thread dies
(then it exits 1, to be replaced). :class:`RelayLauncher` is the supervisor ``asyncrl relay`` runs by default: it
replaces a relay that died after ``relay.backoff_s`` (doubled for each further quick death, like the local worker
launcher, whose supervision it is), at most ``relay.max_restarts`` times. While no relay serves, the node's workers
receive from the broadcaster directly (:mod:`asyncrl.weights.relayed`); a replacement takes over the directory
(removing what its predecessor left) and they return to it.

Who blocks on what: :func:`run_relay`'s main thread sleeps on a stop event (a signal or the relay's death sets it);
the relay's own threads do the work. The supervisor's main thread polls its child every ``POLL_S``.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from typing import Any

from asyncrl.codec import dumps_json, loads_json
from asyncrl.config import RelayConfig, TransportConfig, WorkerConfig, from_dict, to_dict
from asyncrl.weights.relay import WeightRelay
from workers.launcher import LocalWorkerLauncher

__all__ = ["RelayLauncher", "run_relay"]

logger = logging.getLogger(__name__)

POLL_S = 0.2
"""How often the supervisor looks at its relay process."""


def run_relay(cfg: RelayConfig, transport: TransportConfig | None = None, *, relay_id: str | None = None,
              server_key: str | None = None, stop: threading.Event | None = None) -> int:
    """Runs one node relay in this process until ``stop`` is set (SIGTERM and SIGINT set it when called from the main
    thread) or the relay dies; returns the exit status (0: stopped, 1: the relay died).

    Args:
        cfg: the relay's settings (``connect`` and ``directory`` are required).
        transport: the rollout channel's transport settings: this relay's CURVE key (``curve_client_key_file``).
        relay_id: its receiver id at the broadcaster (default: ``relay-<host>-<pid>``).
        server_key: the broadcaster's CURVE public key, when it uses CURVE.
        stop: set it to stop the relay (a caller running it in a thread of its own, e.g. a Ray actor).

    Raises:
        ValueError: ``cfg`` lacks ``connect`` or ``directory``.
        RelayBusy: another live relay serves the directory.
        WeightSyncError: the broadcaster did not answer within ``cfg.timeout_s``.
    """
    if not cfg.connect or not cfg.directory:
        raise ValueError(f"a relay needs relay.connect (the broadcaster's endpoint, got {cfg.connect!r}) and "
                         f"relay.directory (this node's relay directory, got {cfg.directory!r})")
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    relay = WeightRelay(cfg.connect, cfg.directory, relay_id=relay_id, serve=cfg.serve, server_key=server_key,
                        security=transport, delta=cfg.delta, timeout_s=cfg.timeout_s, slot_wait_s=cfg.slot_wait_s,
                        device=cfg.device)
    relay.start()
    print(f"relay {relay.relay_id}: serving {cfg.directory} ({cfg.serve}); workers on this node: "
          f"--set worker.weights.relay={cfg.directory}", file=sys.stderr, flush=True)
    try:
        while not stop.wait(POLL_S):
            if not relay.alive:
                logger.error("relay %s died: %r", relay.relay_id, relay.error)
                return 1
        return 0
    finally:
        relay.close()


class RelayLauncher(LocalWorkerLauncher):
    """Supervises one relay process (``python -m workers.relay``), replacing it when it dies.

    The local worker launcher's supervision with one slot: restarts after ``cfg.backoff_s``, doubled per quick death,
    at most ``cfg.max_restarts`` times; :meth:`poll` from the supervising loop, :meth:`shutdown` to end it.

    Args:
        cfg: the relay's settings.
        transport: the rollout channel's transport settings (this relay's CURVE key).
        relay_id: the relay's receiver id (the same for every replacement: the broadcaster sees one relay per node).
        server_key: the broadcaster's CURVE public key.
        env: extra environment variables for the relay process.
    """

    module = "workers.relay"
    """What each relay process runs (``python -m``)."""

    def __init__(self, cfg: RelayConfig, transport: TransportConfig, *, relay_id: str, server_key: str | None = None,
                 env: dict[str, str] | None = None):
        super().__init__([], 1, WorkerConfig(), transport, name=relay_id, max_restarts=cfg.max_restarts,
                         backoff_s=cfg.backoff_s, backoff_max_s=max(60.0, cfg.backoff_s), env=env)
        self.cfg, self.relay_id, self.server_key = cfg, relay_id, server_key

    def _argv(self, i: int) -> list[str]:
        argv = [sys.executable, "-m", self.module, "--relay-id", self.relay_id, "--parent-pid", str(os.getpid()),
                "--config-json", dumps_json({"relay": to_dict(self.cfg), "transport": to_dict(self.transport)}).decode()]
        return argv + (["--server-key", self.server_key] if self.server_key else [])

    def run(self, stop: threading.Event | None = None) -> int:
        """Starts the relay and replaces it whenever it dies, until ``stop`` is set (or SIGTERM/SIGINT, from the main
        thread) or no restart is left; returns 0 when stopped, 1 when the relay died for good."""
        stop = stop or threading.Event()
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: stop.set())
        self.start()
        try:
            while not stop.wait(POLL_S):
                self.poll()
                if not self.recoverable():
                    logger.error("relay %s: died %d times, no restart left (relay.max_restarts=%s)", self.relay_id,
                                 self.deaths[0], self.cfg.max_restarts)
                    return 1
            return 0
        finally:
            self.shutdown()


def main(argv: list[str] | None = None) -> int:
    """``python -m workers.relay``: one relay process (the supervisor's child)."""
    p = argparse.ArgumentParser(prog="python -m workers.relay")
    p.add_argument("--relay-id", required=True)
    p.add_argument("--parent-pid", type=int)
    p.add_argument("--config-json", required=True)
    p.add_argument("--server-key")
    p.add_argument("--log-level", default=os.environ.get("ASYNCRL_LOG_LEVEL", "WARNING"))
    args = p.parse_args(argv)
    if args.parent_pid is not None:  # a relay must not outlive its supervisor
        from asyncrl.lifeline import die_with_parent

        die_with_parent(args.parent_pid, what=f"relay {args.relay_id}")
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    tree: dict[str, Any] = loads_json(args.config_json)
    cfg = from_dict(RelayConfig, tree.get("relay", {}))
    transport = from_dict(TransportConfig, tree.get("transport", {}))
    return run_relay(cfg, transport, relay_id=args.relay_id, server_key=args.server_key)


if __name__ == "__main__":
    sys.exit(main())

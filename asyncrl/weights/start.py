"""Starting a run's weight channel: rank 0's broadcaster, bound from ``WeightSyncConfig``, its address on every rank;
and a worker's end of it (:func:`open_weight_receiver`).

    rank 0:   setup_weight_broadcaster(cfg.type, ...)   binds (zmq/nccl/cuda_ipc) or creates the run's shm directory
    all:      dist.broadcast_object_list([address])      every rank blocks here until rank 0 has bound

:func:`start_weight_sync` is a collective: every trainer rank calls it once at start-up (after
``init_process_group``), rank 0 alone owns a broadcaster, every rank learns its address (workers are pointed at
it; ``PolicySync`` publishes through it). Nothing is published here: the first publish is ``PolicySync``'s.

Per backend, what the broadcaster is given:

* ``zmq``: ``bind``, ``delta``, ``delta_threads`` and ``security`` (the rollout channel's ``TransportConfig``: its
  CURVE keys and worker allow-list, so a non-loopback ``weights.bind`` is as protected as the pool, and refused
  without them).
* ``nccl`` / ``cuda_ipc``: ``bind`` (a control endpoint, bound like zmq's) and the trainer's ``device``
  (buckets live there).
* ``shm``: a directory named for the run directory under ``/dev/shm`` (or the temp dir), made afresh, so a
  killed run's segments are replaced by its resume, not leaked; :meth:`WeightSync.close` removes it. It holds an
  owner lock (:mod:`asyncrl._owned_dir`): one left by a rank 0 that was killed (torchrun's SIGKILL, an OOM) is
  removed by the next broadcaster that starts on this machine, whatever its run.

A worker opens its end with :func:`open_weight_receiver` (the same ``WeightSyncConfig``, its ``address`` set to the
broadcaster's): the backend's receiver, or behind ``weights.relay`` a
:class:`~asyncrl.weights.relayed.RelayedWeightReceiver` that reads the node's relay and falls back to the broadcaster.
"""

from __future__ import annotations

import hashlib
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from asyncrl._owned_dir import OwnedDir, make_owned_dir
from asyncrl.config import TransportConfig, WeightSyncConfig
from asyncrl.weights import WeightBroadcaster, WeightReceiver, setup_weight_broadcaster, setup_weight_receiver
from asyncrl.weights.relayed import RelayedWeightReceiver
from asyncrl.weights.shm import PREFIX as SHM_PREFIX  # every shm broadcaster sweeps dead directories of this prefix

__all__ = ["WeightSync", "open_weight_receiver", "shm_directory", "start_weight_sync"]


@dataclass(slots=True)
class WeightSync:
    """One rank's view of the run's weight channel."""

    type: str
    """The backend (``WeightSyncConfig.type``)."""
    address: str
    """The broadcaster's address (endpoint, or the shm directory), the same on every rank."""
    broadcaster: WeightBroadcaster | None
    """Rank 0's broadcaster; None on the other ranks."""
    directory: OwnedDir | None = None
    """Rank 0's shm directory (removed on :meth:`close`); None otherwise."""

    def close(self) -> None:
        """Closes rank 0's broadcaster (and removes its shm directory); a no-op on the other ranks."""
        if self.broadcaster is None:
            return
        self.broadcaster.close()
        if self.directory is not None:
            self.directory.close()


def shm_directory(run_dir: str | Path) -> Path:
    """The shm backend's directory for ``run_dir``: the same for a run and its resumes, distinct across runs."""
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return root / f"{SHM_PREFIX}{hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:12]}"


def start_weight_sync(cfg: WeightSyncConfig, *, run_dir: str | Path, device: torch.device,
                      security: TransportConfig | None = None) -> WeightSync:
    """Rank 0 starts the broadcaster ``cfg`` describes; every rank returns with its address (a collective).

    Args:
        cfg: the run's ``weights`` section (``type``, ``bind``, ``bucket_bytes``, ``delta``, ``delta_threads``).
        run_dir: the run directory (names the shm backend's directory).
        device: this rank's device (the nccl / cuda_ipc buckets').
        security: zmq only: the rollout channel's transport settings (CURVE keys, allow-list).

    Raises:
        ValueError: on rank 0, an unknown ``cfg.type`` (the other ranks then fail in the broadcast).
    """
    broadcaster, address, owned = None, [None], None
    if dist.get_rank() == 0:
        if cfg.type == "zmq":
            kw: dict[str, Any] = {"bind": cfg.bind, "delta": cfg.delta, "delta_threads": cfg.delta_threads,
                                  "security": security}
        elif cfg.type in ("nccl", "cuda_ipc"):
            kw = {"bind": cfg.bind, "device": device}
        else:  # a killed run's directory is replaced by its resume's (and swept by any later run's)
            directory = shm_directory(run_dir)
            owned, _ = make_owned_dir(SHM_PREFIX, directory.parent, suffix=directory.name[len(SHM_PREFIX):])
            kw = {"directory": owned.path}
        try:
            broadcaster = setup_weight_broadcaster(cfg.type, bucket_bytes=cfg.bucket_bytes, **kw)
        except BaseException:
            if owned is not None:
                owned.close()
            raise
        address = [broadcaster.address]
    dist.broadcast_object_list(address, src=0)
    return WeightSync(type=cfg.type, address=address[0], broadcaster=broadcaster, directory=owned)


def open_weight_receiver(cfg: WeightSyncConfig, *, receiver_id: str, transport: TransportConfig | None = None,
                         server_key: str | None = None) -> WeightReceiver:
    """A worker's end of the weight channel ``cfg`` describes (not started; ``cfg.type`` must not be ``none``).

    Args:
        cfg: the worker's ``weights`` section: ``type``, ``address`` (the broadcaster's), ``delta``, ``relay``.
        receiver_id: the worker's id.
        transport: ``zmq``: the rollout channel's transport settings (this worker's CURVE key).
        server_key: ``zmq``: the broadcaster's CURVE public key, when it uses CURVE.

    Returns:
        The backend's receiver; with ``cfg.relay``, a :class:`~asyncrl.weights.relayed.RelayedWeightReceiver` reading
        the node's relay, whose direct path is the ``zmq`` receiver of ``cfg.address``.
    """
    if cfg.type == "none" or not cfg.address:
        raise ValueError(f"weights.type={cfg.type!r} with address={cfg.address!r}: a weight receiver needs a backend "
                         "and the broadcaster's address (weights.address)")
    kw: dict[str, Any] = {}
    if cfg.type == "zmq":  # the rollout channel's CURVE keys guard the weight channel too; deltas only over zmq
        kw = {"server_key": server_key, "security": transport, "delta": cfg.delta}
    if cfg.relay is None:
        return setup_weight_receiver(cfg.type, cfg.address, receiver_id=receiver_id, **kw)
    address = cfg.address
    return RelayedWeightReceiver(
        cfg.relay, receiver_id=receiver_id,
        direct=lambda: setup_weight_receiver("zmq", address, receiver_id=receiver_id, **kw))

"""Starting a run's weight channel: rank 0's broadcaster, bound from ``WeightSyncConfig``, its address on every rank.

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
from asyncrl.weights import WeightBroadcaster, setup_weight_broadcaster
from asyncrl.weights.shm import PREFIX as SHM_PREFIX  # every shm broadcaster sweeps dead directories of this prefix

__all__ = ["WeightSync", "shm_directory", "start_weight_sync"]


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

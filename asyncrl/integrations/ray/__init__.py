"""Ray as asyncrl's cluster engine (``asyncrl launch --engine ray``; the ``ray`` extra). Ray places, starts, finds and
restarts processes; every byte of rollouts and weights still goes over asyncrl's own CURVE channels.

::

    asyncrl launch (the driver: RaySupervisor)
      ├─ registry actor "asyncrl-registry-<run>"   the pools' records (endpoints, public keys); join requests
      ├─ placement group: one bundle per trainer rank (sorted by node IP)
      │    └─ TrainerRank actor × W  ── runs recipes/grpo.py with torchrun's variables (a child that dies with it),
      │                                 keeps its pool's allow-list file, reports its pool's record
      └─ RolloutWorker actor × N (one per worker, on nodes with the rollout resources)
           └─ asyncrl worker --registry ... (a child that dies with it), its own CURVE key pair; only the public
              key leaves the actor

Modules: :mod:`~.actors` (the three actor classes), :mod:`~.supervisor` (the gang, the fleet, restarts),
:mod:`~.registry` (how a worker outside Ray reads the registry). Everything here imports Ray; nothing in the core
does (``import asyncrl`` never imports it).
"""

from __future__ import annotations

from typing import Any

__all__ = ["launch_ray"]


def launch_ray(cfg: Any, *, run_file: str | None, overrides: list[str], recipe: str, dry_run: bool = False) -> int:
    """``asyncrl launch --engine ray``: joins ``cluster.address``, runs the trainer gang and the rollout fleet until
    the trainer ends; returns its exit status (:class:`~.supervisor.RaySupervisor`)."""
    from asyncrl.integrations.ray.supervisor import launch

    return launch(cfg, run_file=run_file, overrides=overrides, recipe=recipe, dry_run=dry_run)

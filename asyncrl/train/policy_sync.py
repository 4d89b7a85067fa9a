"""``PolicySync``: the one owner of the policy version, so a training loop cannot forget half of an update.

After each optimizer step a trainer must do two things, in this order, on every rank::

    loader.set_policy_version(v')       the pool's trainer version moves (and the batch that fed the step is
                                        committed, accepted or not)
    broadcaster.publish(weights, v')    rank 0 (FSDP2: every rank takes part in the gathers) sends version v'

Forgetting the first stalls the pipeline (the workers' rollouts of v' are refused as ahead of the trainer);
doing them the other way round lets a worker hold weights newer than its pool's trainer. ``commit()`` does
both, in that order, and only bumps the version for an accepted step::

    sync = PolicySync(model, loader, broadcaster)      # publishes the current version: workers start from it
    for batch in loader:
        verdict = guard.step(loss_of(batch))           # asyncrl.train.guard
        sync.commit(accepted=verdict.accepted)         # set_policy_version(v + accepted); publish if accepted

The published state is :func:`asyncrl.weights.state.policy_state` (plain, DDP, FSDP2, peft), stamped with
the loader's incarnation (:mod:`asyncrl.pool.timeline`): weights and rollouts of a rolled-back run never mix with
this one's. Who blocks on what: ``commit`` waits for the publish (and, with FSDP2, for every rank's gathers),
so every rank calls it once per optimizer step, with the same ``accepted``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal

import torch

from asyncrl.weights.state import policy_state

__all__ = ["PolicySync", "Published"]


@dataclass(frozen=True, slots=True)
class Published:
    """What one :meth:`PolicySync.commit` did."""

    policy_version: int
    """The trainer's policy version after the call."""
    published: bool
    """Weights were published (the step was accepted, or this is the initial publish)."""
    weight_bytes: int
    """Payload of the publish (0 if nothing was published)."""
    publish_s: float
    """Seconds spent publishing on this rank."""


class PolicySync:
    """Publishes the policy's weights and keeps the pool's policy version in step with them.

    Args:
        model: the trained module (plain, DDP, FSDP2 or peft).
        loader: this rank's :class:`~datapipes.loader.RolloutLoader` (anything with ``set_policy_version`` and
            ``incarnation``).
        broadcaster: the :class:`~asyncrl.weights.base.WeightBroadcaster` on rank 0; None on the other ranks
            (with FSDP2 they still take part in every publish's gathers).
        version: the current policy version (0 for a fresh run, the checkpoint's on resume).
        mode: ``"full"`` weights or ``"lora"`` (only the adapter crosses the wire).
        bucket_bytes: FSDP2 gathers at most this many bytes at a time (``WeightSyncConfig.bucket_bytes``).
        publish_initial: publish ``version`` now, so workers start from the trainer's weights (not the model
            directory's); False if the caller has published it already.
    """

    def __init__(self, model: torch.nn.Module, loader: Any, broadcaster: Any | None, *, version: int = 0,
                 mode: Literal["full", "lora"] = "full", bucket_bytes: int = 64 << 20, publish_initial: bool = True):
        if version < 0:
            raise ValueError(f"policy {version=} must be >= 0")
        self.model = model
        self.loader = loader
        self.broadcaster = broadcaster
        self.mode = mode
        self.bucket_bytes = bucket_bytes
        self._version = version
        self.last_publish: Any = None
        """What the broadcaster's last ``publish`` returned (rank 0), for logs."""
        self.loader.set_policy_version(version)
        if publish_initial:
            self._publish()

    @property
    def policy_version(self) -> int:
        """The trainer's current policy version (that of the last published weights)."""
        return self._version

    def commit(self, accepted: bool) -> Published:
        """Ends an optimizer step: the pool moves to the new version first, then the new weights are published.

        Args:
            accepted: the step was taken (the guard's verdict); a rejected one keeps the version and publishes
                nothing, but still commits the batch that fed it.
        """
        new = self._version + bool(accepted)
        self.loader.set_policy_version(new)  # before the publish: no worker holds weights newer than its pool's trainer
        if not accepted:
            return Published(policy_version=new, published=False, weight_bytes=0, publish_s=0.0)
        self._version = new
        return self._publish()

    def _publish(self) -> Published:
        t0 = time.perf_counter()
        state = policy_state(self.model, self.mode, bucket_bytes=self.bucket_bytes)
        with state:  # every rank enters: FSDP2's gathers are collectives
            if self.broadcaster is not None:
                self.last_publish = self.broadcaster.publish(state, self._version, mode=state.mode,
                                                             lora_config=state.lora_config,
                                                             incarnation=self.loader.incarnation)
        return Published(policy_version=self._version, published=True, weight_bytes=state.nbytes,
                         publish_s=time.perf_counter() - t0)

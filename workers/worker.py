"""The rollout worker process loop: lease → generate → reward → send.

::

    pools (one per trainer rank) ══ZeroMQ══► sender I/O thread ──leases──► main thread
                                                                            │ engine.generate (blocks)
                                            sender I/O thread ◄──groups──── │ reward_fn
                                      (heartbeats continue while generating)

The main thread blocks only in ``take_leases`` (waiting for credits) and in the engine. A lease the
worker cannot finish (engine or reward error) is reported as FAILED so the pool re-issues it at
once; the worker carries on. It exits when every pool says SHUTDOWN, when every pool goes silent for
``transport.peer_timeout_s``, or when its parent process (the local launcher) is gone.
"""

from __future__ import annotations

import logging
import os
import time
import traceback
from collections.abc import Sequence

from asyncrl.config import TransportConfig, WorkerConfig
from asyncrl.rollout import Group, Rollout
from asyncrl.transport import ReceivedLease, RolloutSender, setup_rollout_sender
from workers.engines.base import Completion, Engine, GenerationRequest, build_engine
from workers.rewards import RewardFn, load_reward, split_reward

__all__ = ["RolloutWorker", "run_worker"]

logger = logging.getLogger(__name__)


class RolloutWorker:
    """Generates groups for the leases a :class:`RolloutSender` receives.

    Args:
        worker_id: unique name, stamped on every rollout.
        engine: the generation backend.
        reward_fn: batched reward function.
        sender: the connected rollout channel.
        max_batch: most leases per engine call.
        parent_pid: exit when this process is gone (set by the local launcher).
    """

    def __init__(
        self,
        worker_id: str,
        engine: Engine,
        reward_fn: RewardFn,
        sender: RolloutSender,
        *,
        max_batch: int,
        parent_pid: int | None = None,
    ):
        self.worker_id = worker_id
        self.engine = engine
        self.reward_fn = reward_fn
        self.sender = sender
        self.max_batch = max_batch
        self.parent_pid = parent_pid
        self.groups_sent = 0

    def run(self) -> None:
        while not self.sender.done:
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                logger.warning("worker %s: parent %d is gone; exiting", self.worker_id, self.parent_pid)
                return
            leases = self.sender.take_leases(self.max_batch, timeout=0.5)
            if leases:
                self.step(leases)

    def step(self, leases: Sequence[ReceivedLease]) -> None:
        """Generates, rewards and sends one batch of leases."""
        if self.engine.follows_pool_version:
            newest = max(lease.policy_version for lease in leases)
            if newest > self.engine.policy_version:
                self.engine.set_policy_version(newest)
        requests = [
            GenerationRequest(epoch=lease.epoch, prompt_index=lease.prompt_index, prompt=lease.prompt, n=lease.group_size)
            for lease in leases
        ]
        try:
            t0 = time.perf_counter()
            completions = self.engine.generate(requests)
            t1 = time.perf_counter()
            groups = [self._group(lease, cs, t1 - t0) for lease, cs in zip(leases, completions)]
        except Exception as e:  # deliberate fault tolerance: report the batch, keep serving
            logger.exception("worker %s: batch of %d leases failed", self.worker_id, len(leases))
            error = "".join(traceback.format_exception_only(type(e), e)).strip()
            for lease in leases:
                self.sender.send_failed(lease, error)
            return
        for lease, group in zip(leases, groups):
            self.sender.send_group(lease, group)
            self.groups_sent += 1

    def _group(self, lease: ReceivedLease, completions: list[Completion], generate_s: float) -> Group:
        t0 = time.perf_counter()
        values = self.reward_fn([lease.prompt] * len(completions), completions)
        if len(values) != len(completions):
            raise ValueError(f"reward function returned {len(values)} values for {len(completions)} completions")
        reward_s = time.perf_counter() - t0
        rollouts = []
        for sample, (c, value) in enumerate(zip(completions, values)):
            reward, components = split_reward(value)
            r = Rollout(
                epoch=lease.epoch,
                prompt_index=lease.prompt_index,
                sample_index=sample,
                worker_id=self.worker_id,
                policy_version=c.policy_version,
                version_spans=list(c.version_spans),
                prompt_ids=c.prompt_ids,
                response_ids=c.response_ids,
                logprobs=c.logprobs,
                loss_mask=c.loss_mask,
                reward=reward,
                reward_components=components,
                finish_reason=c.finish_reason,
                timings={"generate": generate_s, "reward": reward_s},
                metadata={"attempt_lease": lease.lease_id},
            )
            r.validate()
            rollouts.append(r)
        return Group(epoch=lease.epoch, prompt_index=lease.prompt_index, rollouts=rollouts)


def run_worker(
    endpoints: Sequence[str],
    config: WorkerConfig,
    transport: TransportConfig,
    *,
    worker_id: str,
    parent_pid: int | None = None,
    server_key: str | None = None,
) -> None:
    """Builds the engine and reward, connects to the pools and serves until shut down."""
    engine = build_engine(config.engine)
    reward_fn = load_reward(config.reward)
    sender = setup_rollout_sender(transport, endpoints, worker_id=worker_id, slots=config.slots, server_key=server_key)
    sender.start()
    logger.info("worker %s: serving %s", worker_id, list(endpoints))
    try:
        RolloutWorker(worker_id, engine, reward_fn, sender, max_batch=config.max_batch, parent_pid=parent_pid).run()
    finally:
        sender.close()
        engine.close()

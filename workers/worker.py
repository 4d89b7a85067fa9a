"""The rollout worker process loop: [apply weights] → lease → generate → reward → send.

Two loops, picked by ``worker.streaming``: this module's static one (below: ``max_batch`` leases per
``engine.generate`` call, the batch waits for its longest row; the baseline), and the streaming one of
:mod:`workers.streaming` (continuous batching: ``slots`` leases in the engine at once, each group sent the
moment it is done, weight updates applied in flight). Both serve through this class's weights, rewards, failure
reports and status, as a :class:`~workers.context.WorkerContext`.

::

    pools (one per trainer rank) ══ZeroMQ══► sender I/O thread ──leases──► main thread
                                                                            │ engine.generate (blocks)
                                            sender I/O thread ◄──groups──── │ reward_fn / environment
    broadcaster ══► receiver I/O thread: stage + verify ──► main thread, between batches (safe point):
                                                            engine.apply_weights → receiver.commit

The main thread blocks only in ``take_leases`` (waiting for credits), in the engine, and in applying a staged weight
update. Version fencing: a version is applied only once all of it is staged and verified, and only at a safe point
between generation batches, so every completion carries the version whose weights produced it (the engine reports it).
One timeline: every rollout also carries the trainer incarnation of its weights; a resumed trainer's weights replace a
dead incarnation's whatever their version (the broadcaster is the authority), and a lease granted by an incarnation the
engine does not hold waits up to ``weights.catch_up_s`` for that incarnation's weights before generating (the pool
refuses rollouts off its timeline either way). A lease the worker cannot finish (engine or reward error) is reported as
FAILED with the error text; the worker carries on. Rewards are scored once per batch
(:class:`asyncrl.rewards.RewardSet`: sync functions over the whole batch, async ones per group, concurrently on the
worker's one event loop); a reward function that fails on a group fails only that group's lease. When the engine fails a
batch of several leases, each lease is generated again on its own, so one bad prompt does not fail its batch-mates (the
pool counts failures per prompt and poisons a prompt that keeps failing, :mod:`asyncrl.pool.poison`). Repeated warnings
are throttled (:class:`asyncrl._logging.Throttle`). It exits when every pool says SHUTDOWN, when every pool goes silent
for ``transport.peer_timeout_s``, or when its parent process (the local launcher) is gone.
"""

from __future__ import annotations

import collections
import logging
import os
import time
import traceback
from collections.abc import Sequence
from typing import Any

from asyncrl._logging import Throttle
from asyncrl.config import FaultConfig, TransportConfig, WorkerConfig
from asyncrl.data.images import image_provenance, prompt_images
from asyncrl.pool.admission import MAX_STATUS_KEYS
from asyncrl.rewards.legacy import RewardFn
from asyncrl.rewards.reward_set import RewardError, RewardSet
from asyncrl.rollout import Group, Rollout, make_group_id
from asyncrl.transport import ReceivedLease, RolloutSender, setup_rollout_sender
from asyncrl.weights.verify import WeightVerifier
from workers import faults
from workers.engines import Completion, Engine, GenerationRequest, build_engine
from workers.environments import Environment, env_reward, load_environment, run_episodes
from workers.partial import generate_interruptible
from workers.streaming import StreamingLoop

__all__ = ["RolloutWorker", "run_worker"]

logger = logging.getLogger(__name__)


class RolloutWorker:
    """Generates groups for the leases a :class:`RolloutSender` receives (a :class:`~workers.context.WorkerContext`).

    Args:
        worker_id: unique name, stamped on every rollout.
        engine: the generation backend.
        reward_fn: the reward functions (:class:`~asyncrl.rewards.RewardSet`), or one batched reward function.
        sender: the connected rollout channel.
        max_batch: most leases per engine call (static loop).
        streaming: serve through :class:`workers.streaming.StreamingLoop` (the engine must stream).
        slots: streaming: most leases whose requests are in the engine at once (``worker.slots``).
        weights_in_flight: streaming: ``keep`` or ``abort`` requests in flight when weights are applied.
        parent_pid: exit when this process is gone (set by the local launcher).
    """

    def __init__(
        self,
        worker_id: str,
        engine: Engine,
        reward_fn: RewardSet | RewardFn,
        sender: RolloutSender,
        *,
        max_batch: int,
        parent_pid: int | None = None,
        weights: Any | None = None,
        environment: type[Environment] | None = None,
        interrupt_every_tokens: int = 0,
        fault: FaultConfig | None = None,
        catch_up_s: float = 10.0,
        verifier: WeightVerifier | None = None,
        streaming: bool = False,
        slots: int = 8,
        weights_in_flight: str = "keep",
    ):
        self.worker_id = worker_id
        self.engine = engine
        self.rewards = reward_fn if isinstance(reward_fn, RewardSet) else RewardSet([reward_fn])
        if environment is not None:  # the episode's summed step rewards replace the reward functions
            self.rewards = RewardSet([env_reward], names=["env"])
        self.sender = sender
        self.max_batch = max_batch
        self.parent_pid = parent_pid
        self.weights = weights
        self.environment = environment
        self.interrupt_every_tokens = interrupt_every_tokens
        self.fault = fault or FaultConfig()
        self.catch_up_s = catch_up_s
        self.verifier = verifier
        c = getattr(engine, "config", None)  # what the engine samples with: every rollout says so (asyncrl.train)
        self._sampling = ({"temperature": float(c.temperature), "top_k": int(c.top_k), "top_p": float(c.top_p)}
                          if c is not None and all(hasattr(c, k) for k in ("temperature", "top_k", "top_p")) else None)
        """Post-sync verification of each applied update (:mod:`asyncrl.weights.verify`); None: off."""
        self.groups_sent = 0
        self.rollouts_sent = 0
        self.tokens_generated = 0
        self.weight_failures = 0
        self.lease_failures = 0
        """Leases reported FAILED (each failed alone, after its batch failed)."""
        self.throttle = Throttle(logger)  # a failure that repeats logs a few lines, then one per interval
        self.busy_s = 0.0
        """Seconds spent generating and rewarding (the rest of ``uptime_s`` the worker waited for leases or weights)."""
        self.weight_apply_s = 0.0
        self.started = time.perf_counter()
        self.streaming = streaming
        """The streaming loop (:mod:`workers.streaming`, ``slots`` leases in the engine at once) instead of batches."""
        self.slots = slots
        self.groups_resubmitted = 0
        """Streaming: groups submitted again (aborted by an in-flight update, or finished under another incarnation)."""
        self.inflight_pauses: collections.deque[float] = collections.deque(maxlen=512)
        """Seconds ``engine.apply_weights`` took while requests were in flight (the in-flight pause), newest last."""
        self.inflight_updates = 0
        if streaming:
            engine.weights_in_flight = weights_in_flight
            self._loop: StreamingLoop | None = StreamingLoop(self, slots)  # refuses an engine that does not stream
        else:
            self._loop = None

    def run(self) -> None:
        if self._loop is not None:
            self._loop.run()
            return
        while not self.sender.done:
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                logger.warning("worker %s: parent %d is gone; exiting", self.worker_id, self.parent_pid)
                return
            self.apply_staged_weights()
            leases = self.sender.take_leases(self.max_batch, timeout=0.5)
            if leases:
                self.step(leases)

    def report(self) -> None:
        """What the pools see of this worker in their stats (sent with heartbeats)."""
        if self.sender is None:
            return
        status: dict[str, Any] = {
            "policy_version": self.engine.policy_version,
            "groups_sent": self.groups_sent,
            "rollouts_sent": self.rollouts_sent,
            "tokens_generated": self.tokens_generated,
            "busy_s": round(self.busy_s, 4),
            "weight_apply_s": round(self.weight_apply_s, 4),
            "uptime_s": round(time.perf_counter() - self.started, 4),
            "leases_failed": self.lease_failures,
            "log_lines_suppressed": self.throttle.suppressed_total,
        }
        occupancy = self.engine.occupancy()  # cumulative busy / capacity sequence-seconds (Engine.occupancy)
        if occupancy:
            status["busy_seq_s"] = round(occupancy["busy_seq_s"], 4)
            status["capacity_seq_s"] = round(occupancy["capacity_seq_s"], 4)
        if self.streaming:
            status["groups_resubmitted"] = self.groups_resubmitted
            status.update(self._loop.status(occupancy))  # leases held, time in poll, the engine's idle rows by cause
            status["inflight_updates"] = self.inflight_updates
            if self.inflight_pauses:
                pauses = sorted(self.inflight_pauses)
                status["inflight_pause_p50_s"] = round(pauses[len(pauses) // 2], 5)
                status["inflight_pause_p99_s"] = round(pauses[min(len(pauses) - 1, int(0.99 * len(pauses)))], 5)
        if self.weights is not None:
            weights = self.weights.stats()
            failures = weights.get("failures", 0)
            status["weight_sync_failures"] = failures if isinstance(failures, int) else len(failures)
            # what crossed the wire for weights, full buckets and deltas (weights.delta), cumulative, from a receiver
            # that counts them (zmq; shm has no wire); two keys only: the pool keeps a status of at most
            # MAX_STATUS_KEYS (a bigger status is refused whole, counted statuses_refused)
            if "full_bytes" in weights or "delta_bytes" in weights:
                status["weight_full_bytes"] = weights.get("full_bytes", 0)
                status["weight_delta_bytes"] = weights.get("delta_bytes", 0)
            status["weight_apply_failures"] = self.weight_failures
            if "path" in weights:  # behind a node relay (weights.relay): relay, direct (it is down) or both
                status["weight_path"] = weights["path"]
            if isinstance(shadow := weights.get("shadow"), dict):  # weights.shadow (shm): versions the engine
                # swapped in, and versions staged as views because the shadow was still held (then copied)
                status["weights_via_shadow"] = shadow.get("swaps", 0)
                status["shadow_busy"] = weights.get("shadow_busy", 0)
                status["shadow_mismatch"] = weights.get("shadow_mismatch", 0)  # layout or dtype not the engine's
            if self.verifier is not None:
                status.update(self.verifier.status())
        if len(status) > MAX_STATUS_KEYS:  # the pool would refuse it whole, policy_version included
            self.throttle.error("status_too_big", "worker %s: its status has %d keys, more than the pool keeps "
                                 "(MAX_STATUS_KEYS=%d); the pool keeps the previous one", self.worker_id, len(status),
                                 MAX_STATUS_KEYS)
        self.sender.status = status

    def apply_staged_weights(self, update: Any | None = None) -> bool:
        """Safe point: applies the newest fully staged weights, then commits their version."""
        if self.weights is None:
            return False
        self.report()
        update = update if update is not None else self.weights.poll()
        if update is None:
            return False
        t0 = time.perf_counter()
        try:
            plan = self.verifier.before(update) if self.verifier is not None else None
            if faults.skips_weights(self.fault, update.version):  # injected fault: commit without loading
                self.engine.policy_version = update.version
            elif self.engine.streaming and self.engine.in_flight():  # an in-flight update: time the pause
                t_apply = time.perf_counter()
                self.engine.apply_weights(update)
                self.inflight_pauses.append(time.perf_counter() - t_apply)
                self.inflight_updates += 1
            else:
                self.engine.apply_weights(update)
            self.engine.incarnation = update.incarnation
        except Exception:  # deliberate fault tolerance: keep generating with the version we have
            self.weight_failures += 1
            self.throttle.error("weights_failed", "worker %s: applying weights of version %d failed",
                                 self.worker_id, update.version, exc_info=True)
            return False
        finally:
            self.weight_apply_s += time.perf_counter() - t0
        if plan is not None:
            self._verify(update, plan)
        self.weights.commit(update.version)
        logger.info("worker %s: now at policy version %d", self.worker_id, update.version)
        self.report()
        return True

    def _verify(self, update: Any, plan: Any) -> None:
        """Compares what the engine now holds with the published tensors; a mismatch is counted and named in the
        status, and the worker carries on (the trainer's loader.stats() and debugger report it)."""
        try:
            result = self.verifier.after(self.engine, update, plan)
        except NotImplementedError:  # an engine without weights to read: nothing to verify, ever
            self.verifier = None
            return
        except Exception:  # deliberate fault tolerance: a failed check must not stop generation
            self.throttle.error("verify_failed", "worker %s: verifying weights of version %d failed",
                                 self.worker_id, update.version, exc_info=True)
            return
        if result is not None and not result.ok:
            self.throttle.error("weight_mismatch", "worker %s: weight_mismatch: %s", self.worker_id,
                                 result.describe())

    def step(self, leases: Sequence[ReceivedLease]) -> None:
        """Generates, rewards and sends one batch of leases."""
        newest = max(lease.policy_version for lease in leases)
        live = leases[-1].incarnation
        if self.engine.follows_pool_version:
            if newest > self.engine.policy_version or (live and live != self.engine.incarnation):
                self.engine.set_policy_version(newest)  # a resumed trainer's version may be lower
                self.engine.incarnation = live
        elif self.weights is not None and (newest > self.engine.policy_version
                                           or (live and self.engine.incarnation and live != self.engine.incarnation)):
            # leased at a version (or by a trainer incarnation) this worker has not loaded yet: catch up
            # first, or the groups would be generated only to arrive stale or off the trainer's timeline
            update = self.weights.wait(newest, timeout=self.catch_up_s, incarnation=live or None)
            if update is not None:
                self.apply_staged_weights(update)
        incarnation = self.engine.incarnation
        requests = [
            GenerationRequest(epoch=lease.epoch, prompt_index=lease.prompt_index, prompt=lease.prompt, n=lease.group_size)
            for lease in leases
        ]
        t0 = time.perf_counter()
        failure: Exception | None = None
        culprit = "environment" if self.environment is not None else "engine"  # what a failure is blamed on
        try:
            if self.environment is not None:
                completions = run_episodes(self.engine, self.environment, requests)
            elif self.interrupt_every_tokens and self.weights is not None:
                completions = generate_interruptible(
                    self.engine,
                    requests,
                    chunk_tokens=self.interrupt_every_tokens,
                    max_new_tokens=self.engine.config.max_new_tokens,
                    between_chunks=self.apply_staged_weights,
                )
            else:
                completions = self.engine.generate(requests)
            t1 = time.perf_counter()
            culprit = "worker"  # from here on: not the engine's (reward functions report their own per group)
            if self.engine.incarnation != incarnation:  # weights of another trainer incarnation applied mid-batch
                raise RuntimeError(f"trainer incarnation changed from {incarnation!r} to {self.engine.incarnation!r} "
                                   "during generation (the trainer was resumed); the batch is regenerated")
            groups = self._groups(leases, completions, t1 - t0)
        except Exception as e:  # deliberate fault tolerance: report the failure, keep serving
            failure = e
        finally:
            self.busy_s += time.perf_counter() - t0
        if failure is not None:
            self._failed(leases, failure, culprit)
            return
        for lease, group in zip(leases, groups):
            if isinstance(group, RewardError):  # this group's reward failed: its lease alone, nothing regenerated
                self.lease_failed(lease, group)
                continue
            self.send_group(lease, group)
        self.report()

    def send_group(self, lease: ReceivedLease, group: Group) -> None:
        """Sends a lease's group back to the pool that granted it, and counts it."""
        self.sender.send_group(lease, group)
        self.groups_sent += 1
        self.rollouts_sent += len(group.rollouts)
        self.tokens_generated += sum(int(r.response_ids.numel()) for r in group.rollouts)

    def _failed(self, leases: Sequence[ReceivedLease], error: Exception, culprit: str) -> None:
        """Reports a failed lease to its pool; a failed batch of several is retried lease by lease first."""
        text = "".join(traceback.format_exception_only(type(error), error)).strip()
        if len(leases) > 1:
            self.throttle.warning("batch_failed", "worker %s: batch of %d leases failed (%s); generating them one "
                                   "at a time", self.worker_id, len(leases), text[:300])
            for lease in leases:
                self.step([lease])
            return
        self.lease_failed(leases[0], error, culprit)

    def lease_failed(self, lease: ReceivedLease, error: Exception, culprit: str | None = None) -> None:
        """Reports one lease FAILED with the error's text and what failed (the pool counts it against the prompt):
        ``culprit``, else the error's own (a :class:`~asyncrl.rewards.RewardError`'s ``reward`` or ``decode``), else
        ``engine``."""
        text = "".join(traceback.format_exception_only(type(error), error)).strip()
        culprit = culprit or getattr(error, "culprit", None) or "engine"
        self.lease_failures += 1
        self.throttle.warning("lease_failed", "worker %s: lease %d (prompt %d of epoch %d) failed (%s)",
                               self.worker_id, lease.lease_id, lease.prompt_index, lease.epoch, culprit, exc_info=error)
        self.sender.send_failed(lease, text, culprit=culprit)

    def _groups(self, leases: Sequence[ReceivedLease], completions: list[list[Completion]],
                generate_s: float) -> list[Group | RewardError]:
        """Scores the batch in one call and builds each lease's group (or keeps the error that fails it)."""
        t0 = time.perf_counter()
        decode = self.engine.decode if self.environment is None else None
        scores = self.rewards.score([(lease.prompt, cs) for lease, cs in zip(leases, completions)], decode=decode)
        reward_s = (time.perf_counter() - t0) / max(len(leases), 1)
        return [s if isinstance(s, RewardError) else self.make_group(lease, cs, s, generate_s, reward_s)
                for lease, cs, s in zip(leases, completions, scores)]

    def make_group(self, lease: ReceivedLease, completions: list[Completion], scores: list[tuple[float, dict]],
                   generate_s: float, reward_s: float) -> Group:
        """The group of a lease's scored completions, every rollout stamped with its provenance."""
        rollouts = []
        group_id = make_group_id(lease.epoch, lease.prompt_index)
        images = prompt_images(lease.prompt)  # image prompts: the bytes the engine used travel back, with hashes
        provenance = {"images": [image_provenance(x) for x in images]} if images else {}
        for sample, (c, (reward, components)) in enumerate(zip(completions, scores)):
            if faults.affects_group(self.fault, group_id, lease.lease_id, c.policy_version):  # injected fault
                fault = faults.active(self.fault, c.policy_version)
                faults.corrupt_completion(fault, c)
                reward = faults.corrupt_reward(fault, reward)
            r = Rollout(
                epoch=lease.epoch,
                prompt_index=lease.prompt_index,
                sample_index=sample,
                worker_id=self.worker_id,
                policy_version=c.policy_version,
                incarnation=self.engine.incarnation,
                version_spans=list(c.version_spans),
                prompt_ids=c.prompt_ids,
                response_ids=c.response_ids,
                logprobs=c.logprobs,
                loss_mask=c.loss_mask,
                reward=reward,
                reward_components=components,
                finish_reason=c.finish_reason,
                timings={"generate": generate_s, "reward": reward_s},
                metadata={"attempt_lease": lease.lease_id, **provenance},
                sampling=self._sampling,
                images=images,
            )
            rollouts.append(r)  # validated by the pool on arrival (the one gate for every sender)
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
    """Builds the engine and reward, connects to the pools and serves until shut down.

    Order: the pools are greeted first (a trainer that is gone fails the handshake within
    ``transport.handshake_timeout_s``), saying the worker is not ready; then the weight receiver starts and the
    current weights are awaited (``weights.wait_for_first_s``; a pool's SHUTDOWN ends the wait at once); only then
    do the pools grant it leases, so a late joiner holds none while it waits.
    """
    engine = build_engine(config.engine)
    reward_fn = RewardSet.from_config(config.reward)
    environment = load_environment(config.environment) if config.environment else None
    wants_weights = config.weights.type != "none"
    if wants_weights and not config.weights.address:
        raise ValueError(f"worker.weights.type={config.weights.type!r} needs worker.weights.address")
    sender = setup_rollout_sender(transport, endpoints, worker_id=worker_id, slots=config.slots, server_key=server_key,
                                  streaming=config.streaming, ready=not wants_weights)
    sender.start()
    receiver = None
    try:
        if wants_weights:
            from asyncrl.weights.start import open_weight_receiver

            # the backend's receiver, or behind weights.relay the node relay's with the broadcaster as its fallback
            receiver = open_weight_receiver(config.weights, receiver_id=worker_id, transport=transport,
                                            server_key=server_key)
            if config.weights.shadow:  # the receiver fills the engine's private copy; apply_weights swaps it in
                receiver.attach_shadow(engine.shadow_weights())
            receiver.start()
        worker = RolloutWorker(
            worker_id,
            engine,
            reward_fn,
            sender,
            max_batch=config.max_batch,
            parent_pid=parent_pid,
            weights=receiver,
            environment=environment,
            interrupt_every_tokens=config.interrupt_every_tokens,
            fault=config.testing.worker_fault,
            catch_up_s=config.weights.catch_up_s,
            streaming=config.streaming,
            slots=config.slots,
            weights_in_flight=config.weights_in_flight,
            verifier=None if receiver is None or config.weights.verify == "off" else WeightVerifier(
                config.weights.verify, sample=config.weights.verify_sample,
                full_every=config.weights.verify_full_every),
        )
    except BaseException:
        _close(sender, receiver, reward_fn, engine)
        raise
    try:
        if receiver is not None:  # a late joiner starts from the current weights, not the initial ones
            first = _first_weights(receiver, sender, config.weights.wait_for_first_s)
            if sender.done:
                logger.info("worker %s: the trainer shut down while this worker waited for its weights", worker_id)
                return
            if first is None:
                logger.warning("worker %s: no weights within %s s (worker.weights.wait_for_first_s); "
                               "starting with the engine's own", worker_id, config.weights.wait_for_first_s)
            else:
                worker.apply_staged_weights(first)
            sender.set_ready()
        logger.info("worker %s: serving %s at policy version %d", worker_id, list(endpoints), engine.policy_version)
        worker.run()
    finally:
        _close(sender, receiver, worker.rewards, engine)


def _first_weights(receiver: Any, sender: RolloutSender, timeout: float) -> Any:
    """The trainer's current weights, waited for in short slices so that a pool's SHUTDOWN ends the wait at once."""
    deadline = time.monotonic() + timeout
    while not sender.done and (remaining := deadline - time.monotonic()) > 0:
        first = receiver.wait(0, timeout=min(remaining, 0.25))
        if first is not None:
            return first
    return None


def _close(sender: RolloutSender, receiver: Any, rewards: RewardSet, engine: Engine) -> None:
    sender.close()
    if receiver is not None:
        receiver.close()
    rewards.close()
    engine.close()

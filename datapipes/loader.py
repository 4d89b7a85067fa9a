"""``RolloutLoader``: the trainer-facing loader — a ``torchdata.nodes.Loader`` over rollouts.

::

    prompts ─► PromptLedger ─lease─► workers ══ZeroMQ══► receiver thread ─► RolloutPool
                                                                               │
    for batch in loader:  ◄── Mapper(collate) ◄── Batcher ◄── [GroupFilter] ◄── RolloutPoolNode

Drop-in for a ``DataLoader``: ``for batch in loader`` yields padded tensor batches of whole groups;
``state_dict()`` / ``load_state_dict()`` resume the whole rollout pipeline (ledger, leases,
buffered rollouts, consumed watermark); ``set_policy_version(v)`` after each optimizer step tells
the pool which rollouts are now too stale to yield, and commits the batches that fed the step.

Acknowledged consumption: a yielded batch counts as consumed when the trainer commits the update it
fed, not when it is yielded. ``set_policy_version(v)``, ``commit()`` and ``state_dict()`` commit every
batch yielded so far except the newest ``config.prefetch`` ones, the batches a prefetching consumer
(Lightning: 1) has fetched but not trained yet; the state saves those for re-delivery, so a checkpoint
taken with a batch prefetched loses nothing. (With ``prefetch=0``, the default, a state after k batches
continues at batch k + 1, as for any torchdata node.) Every rollout is stamped with the trainer
incarnation whose weights made it; the pool trains only rollouts of this run's timeline
(:mod:`asyncrl.pool.timeline`).

M:N: with ``world_size`` trainer ranks, each rank's loader owns shard ``rank`` of the prompt ledger
and binds its own pool; when a process group exists the ranks exchange endpoints and every local
worker connects to every rank's pool, so any worker can serve any rank while each rank still
consumes only its own shard (disjoint by construction). A state saved at M ranks resumes at M′: every
rank loads the list of all M ranks' states, and what is left of the epoch is re-dealt (:mod:`asyncrl.pool.reshard`).
Shards are balanced by prompt token count when ``prompt_lengths`` is given.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch.distributed as dist
from torchdata.nodes import Batcher, Loader, Mapper
from torchdata.nodes.loader import LoaderIterator

from asyncrl.config import LoaderConfig, check_keys
from asyncrl.pool.buffer import RolloutPool
from asyncrl.pool.ledger import PromptLedger
from asyncrl.pool.reshard import needs_reshard, reshard
from asyncrl.rollout import Group
from asyncrl.transport import RolloutReceiver, setup_rollout_receiver
from asyncrl.weights.verify import weight_mismatches
from datapipes.collate import TrainBatch, collate_groups
from datapipes.filters import GroupFilter
from datapipes.pool_node import RolloutPoolNode
from datapipes.preflight import check_loader
from workers.launcher import LocalWorkerLauncher

__all__ = ["RolloutLoader"]

logger = logging.getLogger(__name__)


class RolloutLoader(Loader[TrainBatch]):
    """A resumable loader of rollout batches for one trainer rank.

    Args:
        prompts: the dataset: a sequence of msgpack-able items (``{"prompt_ids": [...]}``, ``{"text": ...}``,
            or any dict your engine understands), indexed by ``prompt_index``.
        config: loader settings; keyword ``overrides`` replace its fields.
        rank: this trainer rank (default: from ``torch.distributed`` if initialised, else 0).
        world_size: number of trainer ranks (default: likewise, else 1).
        group_filter: optional predicate; groups for which it is False are dropped (counted).
        collate_fn: ``list[Group] -> batch``; default :func:`~datapipes.collate.collate_groups`.
        prompt_lengths: optional prompt token counts, to balance rank shards by tokens.
        incarnation: this trainer incarnation, the same on every rank and given to the weight broadcaster
            (:func:`asyncrl.pool.timeline.new_incarnation`, once per start or resume); default: a new one. A loader
            rebuilt on a live broadcaster passes its predecessor's (``docs/guides/your-loop.md``).
        config_key: how errors name the settings: ``"LoaderConfig"`` (``LoaderConfig.on_poisoned_prompt``) or the
            run file's section that holds them (``"rollout"`` in ``recipes/grpo.py``: ``rollout.on_poisoned_prompt``).
        **overrides: fields of :class:`~asyncrl.config.LoaderConfig`.

    Raises:
        ValueError: before any socket or worker process exists, for a loader that cannot work
            (:mod:`datapipes.preflight`): an unknown override (with the closest field), a batch larger than this
            rank's shard, local workers of a real engine without a weight channel, an engine model that is not a
            model, a reward function that cannot be imported or fails on the first prompt.
    """

    def __init__(
        self,
        prompts: Sequence[Any],
        config: LoaderConfig | None = None,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        group_filter: Callable[[Group], bool] | None = None,
        collate_fn: Callable[[list[Group]], Any] = collate_groups,
        prompt_lengths: Sequence[int] | None = None,
        incarnation: str | None = None,
        config_key: str = "LoaderConfig",
        **overrides: Any,
    ):
        check_keys(LoaderConfig, overrides)  # a misspelt keyword is named with the closest field
        config = dataclasses.replace(config or LoaderConfig(), **overrides)
        distributed = dist.is_available() and dist.is_initialized()
        rank = rank if rank is not None else (dist.get_rank() if distributed else 0)
        world_size = world_size if world_size is not None else (dist.get_world_size() if distributed else 1)
        self.config = config
        self.rank, self.world_size = rank, world_size
        self.prompts = prompts
        ledger = PromptLedger(
            len(prompts),
            seed=config.seed,
            rank=rank,
            world_size=world_size,
            lease_timeout_s=config.lease_timeout_s,
            shuffle=config.shuffle,
            prompt_lengths=prompt_lengths,
            drop_remainder=config.drop_remainder,
        )
        self.pool = RolloutPool(
            ledger,
            group_size=config.group_size,
            capacity=config.capacity,
            max_staleness=config.max_staleness,
            max_buffer_bytes=config.max_buffer_bytes,
            ordered=config.ordered,
            groups_per_step=config.batch_size if config.lease_within_staleness else None,
            prefetch=config.prefetch,
            incarnation=incarnation,
            max_prompt_failures=config.max_prompt_failures,
            on_poisoned_prompt=config.on_poisoned_prompt,
            failure_backoff_s=config.prompt_failure_backoff_s,
            config_key=config_key,
        )
        self.config_key = config_key
        # every mistake knowable now, before a socket or a worker exists; what the workers need to import the rewards
        worker_env = check_loader(config, prompts, shard_size=ledger.shard_size, world_size=world_size, key=config_key)
        # per yielded batch: (pool reset generation, epoch, prompts); entries of an older generation are void
        self._uncommitted: collections.deque[tuple[int, int, list[int]]] = collections.deque()
        self._fetch_pattern = _FetchPattern(config.prefetch, check=config.check_prefetch, rank=rank)
        # batches the consumer still held when its fetch found the epoch's end (None: the epoch goes on); each
        # update after that trained one of them (Lightning trains its prefetched batch after the StopIteration)
        self._held_at_end: int | None = None
        self.closed = False
        self.receiver: RolloutReceiver = setup_rollout_receiver(
            config.transport, self.pool, prompts.__getitem__, rank=rank, world_size=world_size, gate=config.gate
        )
        self.endpoints = self._exchange_endpoints(self.receiver.start(), distributed)
        self.launcher: LocalWorkerLauncher | None = None
        if config.num_workers > 0:
            targets = self.endpoints if config.serve_all_ranks else [self.endpoint]
            self.launcher = LocalWorkerLauncher(
                targets, config.num_workers, config.worker, config.transport, name=f"r{rank}w",
                device_offset=rank * config.num_workers,  # worker.devices are dealt over every rank's slots
                max_restarts=_max_restarts(config.restart_workers),
                backoff_s=config.restart_backoff_s,
                backoff_max_s=config.restart_backoff_max_s,
                max_failed_starts=config.max_failed_starts,
                env=worker_env,
            )
            self.launcher.start()
        self.pool_node = RolloutPoolNode(
            self.pool,
            self.receiver,
            poll_timeout_s=config.poll_timeout_s,
            wait_timeout_s=config.wait_timeout_s,
            health_check=self._health_check,
            before_state=self._commit_trained,
            on_epoch_end=self._epoch_end,
            min_workers=config.min_workers,
        )
        node = GroupFilter(self.pool_node, group_filter) if group_filter is not None else self.pool_node
        node = Mapper(Batcher(node, config.batch_size, drop_last=False), self._recording(collate_fn))
        super().__init__(node, restart_on_stop_iteration=True)
        self._finalizer = weakref.finalize(self, _close, self.receiver, self.launcher)

    @staticmethod
    def prestart_workers(config: LoaderConfig) -> list[int]:
        """Starts this rank's ``config.num_workers`` local worker interpreters now, before the loader exists: their
        imports overlap the trainer's start-up, and the loader's launcher hands them their command lines
        (:mod:`workers.prestart`). Returns their pids (none with remote workers)."""
        from workers.prestart import prestart_workers

        return prestart_workers(config.num_workers, engine=config.worker.engine.type)

    def __iter__(self) -> LoaderIterator[TrainBatch]:
        """The loader's iterator, as ``torchdata.nodes.Loader.__iter__`` but for the end of an epoch in a loaded state.

        After a loaded state torchdata asks ``has_next()``, which caches the state dict before the ``next()`` that
        raises ``StopIteration`` when the state was saved at an epoch end, and ``reset()`` never clears it: every
        later ``state_dict()`` would return the loaded end-of-epoch state (groups trained twice on the next resume,
        a policy version that stops moving). Here the epoch end is read from the ledger instead, without fetching:
        nothing is cached and nothing blocks (an ``iter()`` right after ``load_state_dict`` must not wait for a
        group, since the workers need the resumed weights first).

        Raises:
            RuntimeError: if the loader is closed.
        """
        self._check_open()
        if self._it is None:
            self._it = _RolloutLoaderIterator(self)
        elif self._iter_for_state_dict:
            self._iter_for_state_dict = False
            return self._it  # made by state_dict() or load_state_dict(): continue from it
        state, self._next_iter_state_dict = self._next_iter_state_dict, None
        self._it.reset(state)
        if state is not None and self.restart_on_stop_iteration and self.pool.ledger.all_delivered:
            self._it.reset(None)  # saved at the end of an epoch: the next one starts
        return self._it

    def load_state_dict(self, state_dict: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        """Restores a state saved by :meth:`state_dict` (this process or another), at once: ``policy_version``,
        the ledger and the buffered rollouts are the saved ones when this returns, so weights published next carry
        the resumed version. The next ``iter()`` continues from it (no group is fetched here).

        Args:
            state_dict: this rank's saved state (a run at the same number of ranks), or the saved states of every
                rank of the run, in rank order, at any number of ranks: an elastic resume. Then what is left of the
                epoch is dealt over this run's ranks, and each group buffered or delivered but not trained goes to
                the rank that now owns its prompt (:mod:`asyncrl.pool.reshard`); every rank must be given the same
                list. :meth:`~asyncrl.checkpoint.Checkpointer.load_loader` reads the list from a checkpoint.

        Raises:
            ValueError: if the state was saved with another dataset, seed or group size, or is one rank's state of a
                run at another number of ranks (give the list), or the states are not one checkpoint of one run.
            RuntimeError: if the loader is closed.
        """
        self._check_open()
        if not isinstance(state_dict, Mapping):
            state_dict = self._state_of_this_rank(list(state_dict))
        self._next_iter_state_dict = state_dict
        self._iter_for_state_dict = False
        iter(self)
        self._iter_for_state_dict = True
        self._fetch_pattern.restart()
        self._held_at_end = None

    def _state_of_this_rank(self, states: list[Mapping[str, Any]]) -> Mapping[str, Any]:
        """This rank's state from the states of every rank of a saved run (re-dealt at another number of ranks)."""
        pools = [RolloutPoolNode.pool_state_in(s) for s in states]
        if not needs_reshard(pools, self.pool.ledger):
            return states[self.rank]
        pool = reshard(pools, self.pool.ledger)
        if self.rank == 0:
            logger.info("resuming a state saved at %d trainer ranks at %d: epoch %d re-dealt, %d groups not yet "
                        "trained on this rank's shard", len(states), self.world_size, pool["ledger"]["epoch"],
                        len(pool["ready"]))
        return RolloutPoolNode.with_pool_state(states[min(self.rank, len(states) - 1)], pool)

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError(f"rank {self.rank}: this RolloutLoader is closed (its receiver and workers are "
                               "stopped); build a new one to continue")

    def _recording(self, collate_fn: Callable[[list[Group]], Any]) -> Callable[[list[Group]], Any]:
        def collate(groups: list[Group]) -> Any:  # runs in the trainer thread, right before the batch is yielded
            if groups:
                self._uncommitted.append((self.pool.min_lease_id, groups[0].epoch, [g.prompt_index for g in groups]))
                self._fetch_pattern.fetched()
                self._held_at_end = None
                # fetching a batch means the consumer is done with all but the newest prefetch before it (FIFO):
                # bounds what is held for re-delivery even in a loop that never commits
                self._commit(keep=self.config.prefetch + 1)
            return collate_fn(groups)

        return collate

    def _exchange_endpoints(self, endpoint: str, distributed: bool) -> list[str]:
        if not distributed or self.world_size == 1:
            return [endpoint]
        endpoints: list[Any] = [None] * self.world_size
        dist.all_gather_object(endpoints, endpoint)
        return [str(e) for e in endpoints]

    def _health_check(self) -> None:
        if self.launcher is None or self.closed:
            return
        workers = self.receiver.stats().get("workers", {})  # who delivered: their deaths are not failed starts
        self.launcher.served(w["pid"] for w in workers.values() if w.get("groups") and isinstance(w.get("pid"), int))
        self.launcher.poll()
        if (error := self.launcher.start_error()) is not None:
            raise error
        if not self.launcher.recoverable():
            tail = self.launcher.stderr_tail(0)
            raise RuntimeError(
                f"rank {self.rank}: all {self.config.num_workers} local rollout workers are dead and none can be "
                f"restarted (restarts used per slot: {self.launcher.restarts}, "
                f"{self.config_key}.restart_workers={self.config.restart_workers!r})"
                + (f"; the last stderr lines of {self.launcher.name}-0:\n{tail}" if tail else "; see their stderr above")
            )

    @property
    def endpoint(self) -> str:
        """This rank's pool address: workers started elsewhere connect here (``asyncrl worker --connect``)."""
        return self.receiver.endpoint

    @property
    def policy_version(self) -> int:
        return self.pool.policy_version

    @property
    def incarnation(self) -> str:
        """This trainer incarnation: publish weights with it (``WeightBroadcaster.publish(..., incarnation=)``)."""
        return self.pool.incarnation

    def set_policy_version(self, version: int) -> None:
        """Tells the pipeline the trainer's policy version and commits the batches that fed the update.

        Call it after every optimizer step, accepted or not (an unchanged version after a rejected update
        still commits: the batch was used). Commits as :meth:`commit` does.

        Raises:
            ValueError: if ``version`` is lower than the current one.
        """
        self._check_open()
        self._updated(self._fetch_pattern.committed(version))
        self.pool.set_policy_version(version)
        self._commit(keep=self.config.prefetch)

    def commit(self) -> int:
        """Marks every group yielded so far as consumed (groups a filter dropped included), except those of
        the newest ``config.prefetch`` batches (fetched ahead, not trained yet). ``state_dict()`` does the
        same first, so the state a checkpoint saves re-delivers exactly the batches not trained yet.
        Returns the number of groups consumed.

        Raises:
            RuntimeError: the consumer is seen to fetch batches ahead of the one it trains while the loader was
                built with a smaller ``prefetch`` (see :class:`_FetchPattern`), or the loader is closed.
        """
        self._check_open()
        self._updated(self._fetch_pattern.committed())
        return self._commit(keep=self.config.prefetch)

    def _epoch_end(self) -> None:
        """The consumer's fetch found the end of the epoch: what it fetched and has not trained, it holds."""
        if self._held_at_end is None:
            generation, epoch = self.pool.min_lease_id, self.pool.ledger.epoch
            held = sum((g, e) == (generation, epoch) for g, e, _ in self._uncommitted)
            self._held_at_end = min(self.config.prefetch, held)

    def _updated(self, trained: bool) -> None:
        if trained and self._held_at_end:
            self._held_at_end -= 1  # it trained one of the batches it held at the epoch's end

    def _commit_trained(self) -> int:
        """What ``state_dict()`` commits first: as :meth:`commit`, but not an update of the loop (and after close)."""
        return self._commit(keep=self.config.prefetch)

    def _commit(self, keep: int) -> int:
        if self._held_at_end is not None:
            keep = min(keep, self._held_at_end)
        while len(self._uncommitted) > keep:
            self._uncommitted.popleft()
        generation, epoch = self.pool.min_lease_id, self.pool.ledger.epoch
        held = {i for g, e, prompts in self._uncommitted if (g, e) == (generation, epoch) for i in prompts}
        return self.pool.commit_delivered(except_prompts=held)

    def stats(self) -> dict[str, Any]:
        """Counters of the pool, ledger, transport and local workers (for logs and metrics); ``prompt_failures``:
        this epoch's prompts whose leases came back FAILED, with the count and the worker's last error text."""
        with self.pool.cond:
            pool = dict(self.pool.stats)
            ledger = dict(self.pool.ledger.counters)
            peak = dict(self.pool.peak)
            in_flight = self.pool.groups_in_flight
            buffered_bytes = self.pool.buffered_bytes
            epoch, consumed = self.pool.ledger.epoch, self.pool.ledger.num_consumed
            delivered = self.pool.num_delivered  # yielded, not trained yet (re-delivered by a checkpoint)
            skipped = self.pool.ledger.skipped  # poisoned prompts skipped this epoch: done, never consumed
            failures = self.pool.ledger.failures()  # the workers' error texts (engine or reward errors)
        return {
            "epoch": epoch,
            "consumed": consumed,
            "delivered": delivered,
            "policy_version": self.pool.policy_version,
            "groups_in_flight": in_flight,
            "buffered_bytes": buffered_bytes,
            "peak": peak,
            "pool": pool,
            "ledger": ledger,
            "transport": (transport := self.receiver.stats()),
            "weight_mismatch": weight_mismatches(transport.get("workers", {})),  # post-sync verification, all workers
            "skipped": skipped,
            "prompt_failures": {str(i): {"failures": n, "error": e} for i, (n, e) in failures.items()},
            "workers": self.launcher.stats() if self.launcher is not None else None,
            "fleet": self.pool_node.fleet_stats(),  # the min_workers floor: pauses, seconds paused
        }

    def rejected_rollouts(self) -> list[dict[str, Any]]:
        """The last few rollouts the gate refused, as received (``RolloutReceiver.rejected_rollouts``)."""
        return self.receiver.rejected_rollouts()

    def close(self) -> None:
        """Stops the receiver (workers are told to shut down) and ends local workers; from now on ``next()`` on any
        of its iterators, ``iter()``, ``set_policy_version`` and ``load_state_dict`` raise, and no worker is
        restarted."""
        self.closed = True
        self.pool_node.close()
        self._finalizer()

    def __enter__(self) -> RolloutLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _RolloutLoaderIterator(LoaderIterator[TrainBatch]):
    """torchdata's ``LoaderIterator`` whose ``reset`` forgets what ``has_next()`` cached (a state dict taken before a
    fetch that may have ended the epoch), so a cached state can never outlive the reset that made it stale."""

    def reset(self, initial_state: dict[str, Any] | None = None):
        super().reset(initial_state)
        self._cached_state_dict = None


class _FetchPattern:
    """Tells a consumer that fetches batches ahead of the one it trains from one that does not, by when it commits.

    A loop that fetches ``p`` batches ahead and trains ``a`` batches per update fetches ``a + p`` batches before its
    first update and ``a`` before each later one that fetched anything (a loop may make several updates from one
    batch, PPO epochs: those fetch nothing and say nothing here). A loader built with a smaller ``prefetch`` would
    count the held batches as consumed at the next commit or ``state_dict()``, and a checkpoint would lose them
    (Lightning fetches one batch ahead). So the first update after the first one that fetched, if it shows more
    fetched ahead than ``prefetch``, raises, naming the fix, before it commits anything. ``check=False``
    (``LoaderConfig.check_prefetch``) turns this off for a loop whose first update really takes more batches than
    the later ones.
    """

    def __init__(self, prefetch: int, *, check: bool, rank: int):
        self.prefetch, self.check, self.rank = prefetch, check, rank
        self.restart()

    def restart(self) -> None:
        """A new iteration from a loaded state: the consumer's first fetches are counted again."""
        self._since = 0  # batches fetched since the last update
        self._first: int | None = None  # fetched before the first update (None: no update yet, or compared already)
        self._updates = 0
        self._version: int | None = None

    def fetched(self) -> None:
        self._since += 1

    def committed(self, version: int | None = None) -> bool:
        """An update: ``set_policy_version(version)`` or ``commit()`` (``version`` None). Returns False for a repeated
        call (nothing fetched since the last one, and no new version): it trained nothing."""
        since, self._since = self._since, 0
        new_version = version is not None and version != self._version
        self._version = version if version is not None else self._version
        if since == 0 and not new_version:
            return False
        self._updates += 1
        if self._updates == 1:
            self._first = since
        elif since and self._first is not None:  # the first later update that fetched: the loop's steady count
            ahead, first, self._first = self._first - since, self._first, None
            if self.check and ahead > self.prefetch:
                raise RuntimeError(
                    f"rank {self.rank}: the training loop fetches {ahead} batch(es) ahead of the one it trains "
                    f"({first} batches fetched before its first update, {since} before a later one), but the "
                    "RolloutLoader was "
                    f"built with prefetch={self.prefetch}: a checkpoint would count the batches it holds as consumed "
                    f"and lose them. Build the loader with prefetch={ahead} (and max_staleness >= {ahead}); under "
                    "PyTorch Lightning use prefetch=1 and the asyncrl.integrations.lightning.RolloutSync callback. "
                    "If your loop really trains more batches in its first update than in later ones, set "
                    "check_prefetch=False."
                )
        return True


def _max_restarts(restart_workers: bool | int) -> int | None:
    """``loader.restart_workers`` as the launcher's per-slot limit: True = None (unlimited), False = 0."""
    if isinstance(restart_workers, bool):
        return None if restart_workers else 0
    return restart_workers


def _close(receiver: RolloutReceiver, launcher: LocalWorkerLauncher | None) -> None:
    receiver.close(shutdown_workers=True)
    if launcher is not None:
        launcher.shutdown(timeout=10)

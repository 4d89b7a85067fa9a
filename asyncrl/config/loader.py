"""The ``rollout`` section: a trainer rank's :class:`~asyncrl.RolloutLoader`, its pool's gate, its workers.

A recipe run file calls it ``rollout:`` because it is the whole rollout side of the run: the loader owns the pool
(capacity, staleness, ordering), the rollout channel (``transport``), what the pool admits (``gate``) and the
local workers it starts (``num_workers``, ``worker``: their engine and reward). Plain data: nothing here blocks or
starts anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from asyncrl.config.transport import TransportConfig
from asyncrl.config.worker import WorkerConfig

__all__ = ["GateConfig", "LoaderConfig"]


@dataclass(kw_only=True, slots=True)
class GateConfig:
    """What the pool's gate admits from workers, beyond the wire format (``asyncrl.pool.gate``)."""

    max_abs_reward: float = 1e6
    """Largest ``|reward|`` (and reward component) accepted; rewards must also be finite in float32, the
    batch dtype (1e39 is finite in float64, inf in float32)."""
    vocab_size: int | None = None
    """Token ids (prompt and response) must be in ``[0, vocab_size)``; the recipe sets it from the model config.
    None: only ``[0, 2**31)`` is checked."""
    min_logprob: float = -1e4
    """Smallest rollout logprob accepted (logprobs must also be <= 0, within ``logprob_tolerance``)."""
    logprob_tolerance: float = 1e-4
    """Logprobs up to this much above 0 are accepted (float rounding in engines)."""
    max_slots_per_peer: int = 64
    """Credits one worker may claim in HELLO; more are capped to this (a hoarding peer cannot stall an epoch)."""
    max_peers: int = 256
    """Most workers (identities) served at once by one pool; HELLOs beyond it are refused (counted)."""

    def __post_init__(self):
        if not self.max_abs_reward > 0 or self.min_logprob >= 0 or self.logprob_tolerance < 0:
            raise ValueError(f"need {self.max_abs_reward=} > 0, {self.min_logprob=} < 0, {self.logprob_tolerance=} >= 0")
        if self.vocab_size is not None and not 0 < self.vocab_size <= 2**31:
            raise ValueError(f"gate.vocab_size={self.vocab_size} must be in [1, 2**31] (or None)")
        if self.max_slots_per_peer < 1 or self.max_peers < 1:
            raise ValueError(f"{self.max_slots_per_peer=} and {self.max_peers=} must be >= 1")


@dataclass(kw_only=True, slots=True)
class LoaderConfig:
    """A trainer rank's :class:`~asyncrl.RolloutLoader`."""

    group_size: int = 4
    """Rollouts per prompt (GRPO ``n``)."""
    batch_size: int = 8
    """Groups per batch yielded to the training loop."""
    max_staleness: int | None = 1
    """Largest ``trainer policy_version - rollout policy_version`` trained on: 0 = synchronous on-policy,
    k = k-step off-policy, None = unbounded. Staler groups are regenerated (counted)."""
    capacity: int = 64
    """Most groups leased + buffered at once for this rank: the memory bound and the backpressure knob."""
    max_buffer_bytes: int | None = None
    """Optional byte bound on buffered rollouts."""
    lease_within_staleness: bool = True
    """Lease only groups that can still be trained within ``max_staleness``: at most
    ``(max_staleness + 1) * batch_size`` groups of the current step in flight (AReaL's staleness control),
    so no generation is wasted on groups that would arrive too stale, and ``max_staleness=0`` is truly
    synchronous. False: only ``capacity`` bounds generation; workers run ahead and stale groups are
    dropped and regenerated (counted). Needs ``set_policy_version`` after every optimizer step."""
    prefetch: int = 0
    """Batches your loop fetches ahead of the one it trains: 0 for a plain ``for batch in loader`` loop, 1 for
    PyTorch Lightning (it fetches the next batch before training the current one). A yielded batch counts
    as consumed only once the update it fed is committed (``set_policy_version``/``commit``), and staleness
    is judged at the version it will be trained at; must be <= ``max_staleness``."""
    check_prefetch: bool = True
    """Refuse a loop seen to fetch more batches ahead than ``prefetch`` (it fetched more batches before its first
    update than before the next one that fetched any): ``set_policy_version``/``commit`` raise with the fix, since a
    checkpoint would lose the batches it holds. False: trust ``prefetch`` (a loop whose first update really takes
    more batches than the later ones)."""
    ordered: bool = False
    """Yield groups in the ledger's (seeded) order rather than as they arrive: reproducible batches, at the
    cost of head-of-line blocking behind the slowest group."""
    seed: int = 0
    """Seed of the per-epoch prompt order."""
    shuffle: bool = True
    """Shuffle prompts per epoch."""
    drop_remainder: bool = False
    """Give every trainer rank the same number of prompts (needed for lock-step DDP)."""
    lease_timeout_s: float = 300.0
    """A prompt leased for longer than this is re-issued to another worker."""
    min_workers: int = 0
    """The fleet's floor: while fewer workers serve this rank's pool (greeted, alive, holding the trainer's weights),
    ``next()`` pauses: it yields nothing (groups still arrive and are buffered), ``wait_timeout_s`` does not run, and
    a warning says so every minute; it resumes when enough serve again (``stats()["fleet"]``: pauses, seconds
    paused). For remote fleets that lose and regain workers (``cluster.fleet.min_workers`` sets it under Ray);
    0 = no floor: the run goes on with whatever workers it has."""
    num_workers: int = 0
    """Local worker processes this rank starts (like ``DataLoader(num_workers=N)``); 0 = workers are
    started elsewhere with ``asyncrl worker --connect ADDR``."""
    restart_workers: bool | int = True
    """Restart local workers that die (their leases are re-issued either way): True = always, False or 0 =
    never, n = at most n restarts per worker slot (then the slot stays empty; with every slot empty
    ``next()`` raises). Restarts of one slot back off exponentially (``restart_backoff_s``)."""
    restart_backoff_s: float = 1.0
    """Wait before restarting a worker slot after its first death; doubled for each further death of a worker
    that ran less than ``restart_backoff_max_s``, up to ``restart_backoff_max_s`` (a longer run resets it)."""
    restart_backoff_max_s: float = 60.0
    """Longest wait between restarts of a slot; a worker that stayed up this long resets its slot's backoff."""
    max_failed_starts: int | None = 3
    """A local worker that dies this many times in a row before its first group, with the same error each time
    (its last stderr line), cannot start: it is not restarted again and ``next()`` raises
    ``WorkerStartError`` with its last stderr lines. Workers that did serve are restarted as ``restart_workers``
    says. None: restart as ``restart_workers`` says, whatever the error."""
    max_prompt_failures: int | None = 3
    """A prompt whose leases come back FAILED (engine or reward error) this many times in an epoch is
    poisoned (``on_poisoned_prompt``); None = re-issue it forever."""
    on_poisoned_prompt: Literal["raise", "skip"] = "raise"
    """``raise``: ``next(loader)`` raises ``PoisonedPromptError`` naming the prompt (epoch, index), the count
    and the worker's error; ``skip``: the prompt is skipped for the epoch, never trained, and counted
    (``stats()["pool"]["skipped_poisoned"]``, the prompts in ``stats()["skipped"]``)."""
    prompt_failure_backoff_s: float = 0.5
    """A failed prompt is leased again after this many seconds, doubled per failed attempt (at most 30 s), so
    a prompt that always fails does not spin a worker; 0 = at once."""
    serve_all_ranks: bool = True
    """With a process group, local workers connect to every rank's pool (M:N); else only to this rank's."""
    poll_timeout_s: float = 1.0
    """How long ``next()`` waits per poll before re-checking worker health."""
    wait_timeout_s: float | None = 600.0
    """``next()`` raises ``TimeoutError`` if no group arrives for this long, saying why none came (groups dropped
    as stale with the workers' and the trainer's versions, failed leases, no worker connected, ...). Raise it for
    generations longer than this (long reasoning on a large model, workers started by hand); None: wait forever."""
    frozen_workers: bool = False
    """Accept local workers whose engine has real weights (``hf``, ``vllm``) but no weight channel
    (``worker.weights.type='none'``): they generate with their model directory's weights for the whole run. For a
    loop that never moves the policy version (evaluation, data collection); once a trainer's version passes
    ``max_staleness`` every group they make is stale, so by default such a loader is refused at construction."""
    transport: TransportConfig = field(default_factory=TransportConfig)
    gate: GateConfig = field(default_factory=GateConfig)
    """What the pool admits from workers: value ranges, per-peer caps (``asyncrl.pool.gate``)."""
    worker: WorkerConfig = field(default_factory=WorkerConfig)

    def __post_init__(self):
        if self.group_size < 1 or self.batch_size < 1:
            raise ValueError(f"{self.group_size=} and {self.batch_size=} must be >= 1")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"{self.max_staleness=} must be >= 0, or None for unbounded")
        if self.capacity < 1:
            raise ValueError(f"{self.capacity=} must be >= 1")
        if not isinstance(self.restart_workers, (bool, int)) or self.restart_workers < 0:
            raise ValueError(f"loader.restart_workers={self.restart_workers!r} must be True (always), False or 0 "
                             "(never), or a number of restarts per worker slot >= 0")
        if not 0 <= self.restart_backoff_s <= self.restart_backoff_max_s:
            raise ValueError(f"need 0 <= {self.restart_backoff_s=} <= {self.restart_backoff_max_s=}")
        if self.max_prompt_failures is not None and self.max_prompt_failures < 1:
            raise ValueError(f"{self.max_prompt_failures=} must be >= 1, or None to re-issue failed prompts forever")
        if self.on_poisoned_prompt not in ("raise", "skip") or self.prompt_failure_backoff_s < 0:
            raise ValueError(f"need {self.on_poisoned_prompt=} in ('raise', 'skip') and "
                             f"{self.prompt_failure_backoff_s=} >= 0")
        if self.max_failed_starts is not None and self.max_failed_starts < 1:
            raise ValueError(f"loader.max_failed_starts={self.max_failed_starts} must be >= 1, or None to restart "
                             "workers that cannot start as restart_workers says")
        if type(self.min_workers) is not int or self.min_workers < 0:
            raise ValueError(f"loader.min_workers={self.min_workers!r} must be an integer >= 0 (0: no floor)")
        if self.wait_timeout_s is not None and not self.wait_timeout_s > 0:
            raise ValueError(f"loader.wait_timeout_s={self.wait_timeout_s} must be > 0 seconds, or None to wait "
                             "forever")
        if self.prefetch < 0 or (self.max_staleness is not None and self.prefetch > self.max_staleness):
            raise ValueError(f"{self.prefetch=} must be in [0, {self.max_staleness=}]: a consumer that fetches p "
                             "batches ahead trains each one up to p versions after it is taken")

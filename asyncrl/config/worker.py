"""The ``worker`` section: one rollout worker process, its reward and what it injects for tests.

The worker's engine and weight sync have their own modules (:mod:`asyncrl.config.engine`,
:mod:`asyncrl.config.weights`). Configs travel to worker processes as JSON (:func:`asyncrl.config.to_dict`).
Plain data: nothing here blocks or starts anything.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from asyncrl.config.engine import EngineConfig, FakeEngineConfig
from asyncrl.config.renames import MOVED_REWARDS
from asyncrl.config.testing import TestingConfig
from asyncrl.config.weights import WeightSyncConfig

__all__ = ["RewardConfig", "WorkerConfig"]


@dataclass(kw_only=True, slots=True)
class RewardConfig:
    """Reward functions and their weights (TRL's ``reward_funcs`` / ``reward_weights``; ``asyncrl.rewards``)."""

    funcs: list[str] = field(default_factory=lambda: ["fake"])
    """Built-in names (``math``, ``format``, ``reasoning_gym``, ``arithmetic``, ``visual``, ``fake``) or
    ``module:function``, each a batched function with TRL's signature, sync or ``async def``; each one's rewards are
    logged under its name."""
    weights: list[float] | None = None
    """One weight per function: a rollout's reward is ``sum(weight * reward)`` over the functions that scored it.
    None: every weight 1.0."""

    def __post_init__(self):
        if isinstance(self.funcs, str):
            self.funcs = [self.funcs]
        if not self.funcs or not all(isinstance(f, str) and f for f in self.funcs):
            raise ValueError(f"reward.funcs={self.funcs!r} must be a non-empty list of names or 'module:function'")
        for spec in self.funcs:
            if spec in MOVED_REWARDS:
                raise ValueError(f"reward function {spec!r} moved: use {MOVED_REWARDS[spec]!r}")
        if self.weights is not None and len(self.weights) != len(self.funcs):
            raise ValueError(f"reward.weights has {len(self.weights)} values for {len(self.funcs)} reward.funcs "
                             f"({self.funcs}); give one weight per function, or none for all 1.0")



@dataclass(kw_only=True, slots=True)
class WorkerConfig:
    """One rollout worker process."""

    engine: EngineConfig = field(default_factory=FakeEngineConfig)
    """The generation backend, by ``type`` (:mod:`asyncrl.config.engine`)."""
    reward: RewardConfig | str = field(default_factory=RewardConfig)
    """The reward functions and weights (the run's one reward: a recipe run file sets it as ``rollout.worker.reward``);
    a plain name or ``module:function`` string is one function of weight 1."""
    environment: str | None = None
    """``module:Class`` of a multi-turn environment; its step rewards replace the reward function."""
    weights: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    """Weight sync from the trainer."""
    interrupt_every_tokens: int = 0
    """Static mode only: 0: new weights are applied between generation batches (safe points). c > 0: generate in
    chunks of c tokens and apply new weights between chunks (partial rollouts by re-submission, with per-token
    version spans). ``streaming`` replaces it: a streaming engine takes weight updates in flight."""
    streaming: bool = False
    """True: the streaming loop (:mod:`workers.streaming`): up to ``slots`` leases' requests decode in the engine
    at once (continuous batching), a new lease is admitted as soon as one finishes, each group is rewarded and
    sent the moment its own ``n`` samples are done, and weight updates are applied in flight (see
    ``weights_in_flight``). Needs an engine that streams (``fake``; ``hf``/``vllm`` where they implement it).
    False: the static loop (``max_batch`` leases per ``engine.generate`` call, each batch waits for its
    longest row): the baseline, and what the reproducible-regime tests use."""
    weights_in_flight: Literal["keep", "keep_cache", "abort"] = "keep"
    """Streaming mode: what an update staged while requests are in flight does to them. ``keep``: they continue
    under the new weights (their later tokens carry the new version in ``version_spans``; a rollout's
    ``policy_version`` stays its oldest token's). ``abort``: they are aborted, nothing of them is kept, and
    their leases are submitted again once, wholly under the new weights (counted ``groups_resubmitted``).
    ``keep_cache`` (HF and fake engines): as ``keep`` but the KV cache the old weights computed is kept (no
    re-prefill; the pause is the weight load alone): a token after the update carries the new version and the
    logprob of the new weights attending to the old weights' keys/values of its prefix (what sampled it, not
    what the trainer recomputes under either version); ``policy_version`` stays the oldest token's."""
    slots: int = 8
    """Leases (credits) the worker holds per pool at once: generation never runs ahead of these. Twice
    ``max_batch`` lets the next batch's leases arrive while this one generates."""
    max_batch: int = 4
    """Most leases generated together in one engine call."""
    devices: list[str] = field(default_factory=list)
    """Local workers (``loader.num_workers``): the device of each worker slot, dealt round-robin over all ranks'
    slots (slot ``i`` of rank ``r`` gets ``devices[(r * num_workers + i) % len(devices)]``): ``cuda:3``, ``cuda:0,1``
    (an engine with ``tensor_parallel_size: 2``) or ``cpu``. The worker process sees only those GPUs
    (``CUDA_VISIBLE_DEVICES``) and its engine runs on the first. Empty: ``engine.device``, every GPU visible."""
    testing: TestingConfig = field(default_factory=TestingConfig)
    """Fault injection for the project's tests (``worker_fault``; off by default). A recipe run file sets it in its
    top-level ``testing:`` section and the recipe copies it here."""

    def __post_init__(self):
        if isinstance(self.reward, str):
            self.reward = RewardConfig(funcs=[self.reward])
        if self.slots < 1 or self.max_batch < 1:
            raise ValueError(f"{self.slots=} and {self.max_batch=} must be >= 1")
        for device in self.devices:
            if not re.fullmatch(r"cpu|cuda(:\d+(,\d+)*)?", device):
                raise ValueError(f"worker.devices entry {device!r} must be 'cpu', 'cuda', 'cuda:N' or 'cuda:N,M,...'")
            gpus = device.partition(":")[2].count(",") + 1 if ":" in device else None
            if self.engine.type == "vllm" and gpus is not None and gpus != self.engine.tensor_parallel_size:
                raise ValueError(f"worker.devices entry {device!r} names {gpus} GPUs but engine.tensor_parallel_size="
                                 f"{self.engine.tensor_parallel_size}: give each vLLM worker as many GPUs as it spans")
        if self.interrupt_every_tokens < 0:
            raise ValueError(f"{self.interrupt_every_tokens=} must be >= 0")
        if self.weights_in_flight not in ("keep", "keep_cache", "abort"):
            raise ValueError(f"worker.weights_in_flight={self.weights_in_flight!r} must be 'keep', 'keep_cache' or "
                             "'abort'")
        if self.weights_in_flight == "keep_cache" and self.engine.type not in ("hf", "fake"):
            raise ValueError(f"worker.weights_in_flight='keep_cache' needs engine.type hf or fake, not "
                             f"{self.engine.type!r} (vLLM's keep recomputes the cache: use 'keep')")
        if self.streaming and self.environment:
            raise ValueError("worker.streaming does not combine with worker.environment (multi-turn episodes run "
                             "turn by turn in the static loop)")
        if self.streaming and self.interrupt_every_tokens:
            raise ValueError(f"worker.streaming replaces worker.interrupt_every_tokens={self.interrupt_every_tokens}: "
                             "a streaming engine applies weights in flight; set it to 0")
        if self.interrupt_every_tokens and self.environment:
            raise ValueError("worker.interrupt_every_tokens does not combine with worker.environment (multi-turn); "
                             "multi-turn episodes already apply weights between turns' batches")



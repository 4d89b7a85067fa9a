"""The ``debug`` section: the RL debugger in a training loop (``asyncrl.debug``), and the names of its detectors.

Plain data: nothing here blocks or starts anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["DETECTORS", "DebugConfig"]

DETECTORS = ("nonfinite", "guard_rejection", "version_lag", "logprob_mismatch", "logprob_shift", "reward_shift",
             "ratio_tail", "rejected_rollouts", "weight_mismatch")


@dataclass(kw_only=True, slots=True)
class DebugConfig:
    """The RL debugger in a training loop."""

    enabled: bool = True
    """Write the per-step record and run the detectors."""
    detectors: list[str] = field(default_factory=lambda: list(DETECTORS))
    """Which detectors run (all by default)."""
    window: int = 20
    """Steps of history the shift detectors compare against."""
    min_history: int = 3
    """Shift detectors stay quiet until they have this many steps of history."""
    shift_z: float = 8.0
    """Robust z-score (median/MAD, with a floor on the scale) above which a shift fires."""
    logprob_tol: float = 1e-3
    """Largest |trainer - rollout logprob| tolerated on on-policy tokens. fp32 engines agree to ~1e-6
    (asyncrl align); bf16 needs ~5e-2."""
    max_version_lag: int | None = None
    """Bound of ``version_lag``; None = the loader's ``max_staleness`` (no check if that is None too)."""
    ratio_tail_fraction: float = 0.2
    """``ratio_tail`` fires when more than this fraction of tokens has a ratio outside [0.5, 2). Healthy
    one-step-stale batches of the tiny recipe reach ~8 % (it moves fast); a shifted mask gives ~95 %."""
    max_dumps: int = 100
    """Most dumps one rank writes in a run (the anomaly lines are always written)."""
    report: bool = True
    """Rank 0 draws ``report.png`` and writes ``report/index.html`` when the run ends (a few seconds of matplotlib,
    independent of ``enabled``). Off, the run leaves only their inputs (``metrics.jsonl``, ``debug/``):
    ``asyncrl report RUN_DIR`` writes the page from them later. Tests that do not look at the report turn it off."""
    samples_every: int = 10
    """Every this many steps (and at the first and the last), each rank appends ``samples_per_step`` of its batch's
    rollouts to ``run_dir/samples.jsonl``: prompt and completion decoded with the run's tokenizer, each reward
    component, the rollout logprob, policy version and staleness (``asyncrl.debug.samples``); rank 0's go to the
    trackers (``report_to``) as a table. 0: none periodically (an anomaly's batch is still written while
    ``enabled``)."""
    samples_per_step: int = 8
    """Rollouts written per sampled step and rank: the batch's first rows, so whole groups first. An anomaly's batch
    is written whole (at most ``max_dumps`` of them, as its dump), and its anomaly line names those rows."""

    def __post_init__(self):
        unknown = set(self.detectors) - set(DETECTORS)
        if unknown:
            raise ValueError(f"unknown debug.detectors {sorted(unknown)}; choose from {list(DETECTORS)}")
        if self.window < 1 or self.min_history < 1 or self.logprob_tol <= 0:
            raise ValueError(f"need {self.window=} >= 1, {self.min_history=} >= 1, {self.logprob_tol=} > 0")
        if self.samples_every < 0 or self.samples_per_step < 1:
            raise ValueError(f"debug.samples_every={self.samples_every} must be >= 0 (0: off) and "
                             f"debug.samples_per_step={self.samples_per_step} >= 1")

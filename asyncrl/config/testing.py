"""The ``testing:`` section: every knob that exists only for the project's own tests, in one place.

Fault injection into the trainer's loop (pauses to be killed at, NaN rewards) and into rollout workers
(:class:`FaultConfig`, read by ``workers.faults``). A recipe run file sets them under ``testing:``; the recipe hands
the section to its workers inside :attr:`asyncrl.config.WorkerConfig.testing`. Nothing here belongs in a real run:
the defaults inject nothing. Plain data: nothing here blocks or starts anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from asyncrl.checkpoint.checkpointer import SAVE_POINTS

__all__ = ["FaultConfig", "TestingConfig"]


@dataclass(kw_only=True, slots=True)
class FaultConfig:
    """Fault injection into a worker, for the debugger's own tests (``workers.faults``). Never in production."""

    kind: Literal["none", "stale_weights", "shift_logprobs", "nan_logprobs", "exploding_reward"] = "none"
    """``stale_weights``: keep the old weights but stamp the new version; ``shift_logprobs``: report each
    logprob one position late (a mask/position off-by-one); ``nan_logprobs``: a NaN logprob per rollout;
    ``exploding_reward``: rewards times ``scale``."""
    from_version: int = 1
    """The fault starts with the first rollout (or weight update) of this policy version."""
    fraction: float = 1.0
    """Fraction of groups affected (drawn per group and attempt, so a rejected group can pass on re-lease)."""
    scale: float = 1000.0
    """``exploding_reward``: the factor."""
    until_version: int | None = None
    """The fault ends before the first rollout (or weight update) of this policy version; None: it lasts to the end
    of the run. A ``stale_weights`` window that ends leaves the engine on whatever the skipped updates left (a delta
    chain stays broken): put it last."""
    then: FaultConfig | None = None
    """The next fault, a window of its own (``testing.worker_fault.then.kind=...``): one run can inject several
    faults in turn, each on healthy history. Needs this fault's ``until_version``, at or before the next one's
    ``from_version``."""

    def __post_init__(self):
        if not 0 < self.fraction <= 1 or self.from_version < 0:
            raise ValueError(f"need 0 < {self.fraction=} <= 1 and {self.from_version=} >= 0")
        if self.until_version is not None and self.until_version <= self.from_version:
            raise ValueError(f"testing.worker_fault: {self.until_version=} must be above {self.from_version=}")
        if self.then is not None and (self.until_version is None or self.then.from_version < self.until_version):
            raise ValueError(f"testing.worker_fault.then starts at from_version={self.then.from_version}, which must be "
                             f"at or after this fault's until_version={self.until_version} (set it: windows may not "
                             "overlap)")


@dataclass(kw_only=True, slots=True)
class TestingConfig:
    """Fault injection for the project's tests: where the trainer pauses (to be killed there), a poisoned step,
    and the workers' faults. The defaults inject nothing."""

    __test__ = False  # a config class, not a pytest test class

    pause_after_step: int | None = None
    """Every trainer rank sleeps after logging this step (to be killed mid-run)."""
    step_delay_s: float = 0.0
    """Every trainer rank sleeps this long after each step: a run slow enough for a test to act on it mid-way (kill
    a worker, remove a node) on a machine where the tiny run takes a fraction of a second per step."""
    pause_in_save_at_step: int | None = None
    """Rank 0 sleeps inside the save of this step, after ``pause_in_save_point`` (the other ranks wait at the
    save's last barrier), to be killed in the middle of a save."""
    pause_in_save_point: str = "renamed"
    """One of ``asyncrl.checkpoint.SAVE_POINTS``: "staged", "marked", "renamed" (the new step-N exists, latest
    still names the previous one), "pointed", "pruned"."""
    inject_nan_at_step: int | None = None
    """NaN rewards in this step's batch (the update guard must reject the step)."""
    worker_fault: FaultConfig = field(default_factory=FaultConfig)
    """Fault injection into the rollout workers (the debugger's detectors must fire)."""

    def __post_init__(self) -> None:
        if self.pause_in_save_point not in SAVE_POINTS:
            raise ValueError(f"testing.pause_in_save_point={self.pause_in_save_point!r} must be one of {SAVE_POINTS}")

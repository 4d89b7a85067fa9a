"""The ``report_to`` key and the ``tracking`` section: which experiment trackers a run logs to, and where.

``report_to`` is TRL's key with TRL's values: a list of ``tensorboard``, ``wandb``, ``mlflow``, or ``"all"`` (every one
of them that is installed) or ``"none"``. ``asyncrl.integrations.trackers`` reads both (on trainer rank 0 only);
each tracker is an optional extra (``pip install 'asyncrl[wandb]'``). Plain data: nothing here blocks, starts or
imports a tracker.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["REPORT_TO", "TrackingConfig", "normalize_report_to"]

REPORT_TO = ("tensorboard", "wandb", "mlflow")
"""The trackers ``report_to`` may name, each an extra of the same name."""


def normalize_report_to(report_to: list[str] | str | None) -> list[str]:
    """``report_to`` as a list of tracker names (``"all"`` stays ``["all"]``; ``"none"``/None is ``[]``).

    Raises:
        ValueError: a name that is not a tracker, with the ones there are.
    """
    names = [] if report_to in (None, "none") else [report_to] if isinstance(report_to, str) else list(report_to)
    names = [n for n in names if n != "none"]
    unknown = [n for n in names if n not in (*REPORT_TO, "all")]
    if unknown:
        raise ValueError(f"report_to={report_to!r}: unknown tracker(s) {unknown}; choose from {list(REPORT_TO)}, "
                         "'all' or 'none'")
    return list(dict.fromkeys(names))


@dataclass(kw_only=True, slots=True)
class TrackingConfig:
    """Where the trackers named by ``report_to`` write (``asyncrl.integrations.trackers``)."""

    project: str = "asyncrl"
    """The W&B project and the MLflow experiment the run is logged under."""
    run_name: str | None = None
    """The run's name in W&B and MLflow; None: the run directory's folder name."""
    wandb_entity: str | None = None
    """The W&B entity (team or user); None: W&B's default (``WANDB_ENTITY`` or the logged-in user's)."""
    tensorboard_dir: str | None = None
    """TensorBoard's log directory; None: ``{run_dir}/tensorboard``."""
    mlflow_tracking_uri: str | None = None
    """The MLflow tracking URI; None: ``MLFLOW_TRACKING_URI`` when set, else a local SQLite store
    ``sqlite:///{run_dir}/mlflow.db`` with artifacts in ``{run_dir}/mlartifacts`` (MLflow 3 refuses its old
    file store by default)."""

"""Experiment trackers with TRL's vocabulary: ``report_to: [tensorboard, wandb, mlflow]``.

The recipe (or any loop) holds one :class:`Trackers` on trainer rank 0 and nowhere else::

    trackers = Trackers.open(cfg.report_to, cfg.tracking, run_dir=run_dir, config=to_dict(cfg),
                             resume_step=step if resumed else None)
    trackers.log_step(step, record)       # metrics.jsonl's numbers, the guard's verdict (and its reason if rejected)
    trackers.log_samples(step, rows)      # asyncrl.debug.samples rows, as one table
    trackers.log_summary(summary)         # asyncrl.debug.summary.run_summary, at the end
    trackers.close(ok=True)

What each tracker gets, and how a ``--resume`` continues it (``trackers.json`` in the run directory keeps the ids):

==============  ==============================================  ==================================================
tracker         metrics, config, samples, verdicts, summary     resume
==============  ==============================================  ==================================================
``tensorboard`` scalars; the config, samples (a Markdown table)  the same log directory with ``purge_step``: the
                and rejection reasons as text; the summary       rolled-back steps' events are hidden
``wandb``       ``run.log`` against ``train/global_step``;       the same run id (``resume="allow"``); offline runs
                ``wandb.init(config=...)``; ``wandb.Table``;     keep the id, ``wandb sync`` joins them
                ``guard/rejection`` strings; ``run.summary``
``mlflow``      ``log_batch``; params (flattened) and            the same run id, reopened; redone steps are logged
                ``config.json``; ``log_table`` to                again at the same step numbers
                ``samples.json`` and ``guard_rejections.json``;
                ``summary.json`` and a ``verdict`` tag
==============  ==============================================  ==================================================

Who blocks on what: every call runs on the trainer's thread and blocks for its library's write (an event file, W&B's
local service, MLflow's store: a file, or a tracking server over the network). The libraries are imported only
when named (each an extra: ``pip install 'asyncrl[wandb]'``); nothing here reaches the network unless the tracker is
configured to (``WANDB_MODE=offline``; MLflow's default store here is a local SQLite file). Application layer:
core ``asyncrl`` never imports this module.
"""

from __future__ import annotations

import importlib.util
import math
import os
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import orjson

from asyncrl.config.tracking import REPORT_TO, TrackingConfig, normalize_report_to
from asyncrl.debug.samples import table_columns

__all__ = ["STATE_FILE", "MlflowTracker", "TensorBoardTracker", "Tracker", "Trackers", "WandbTracker",
           "resolve_report_to", "step_metrics"]

STATE_FILE = "trackers.json"
"""In the run directory: each tracker's run id or log directory, read back by a ``--resume``."""
_MODULE = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
_SKIP = {"step", "time", "accepted", "guard_reason", "staleness_hist", "pipeline"}
MLFLOW_PARAM_CHARS = 6000
"""MLflow's limit on a parameter's value; longer values are cut (the full config is ``config.json``)."""


def _installed(name: str) -> bool:
    return importlib.util.find_spec(_MODULE[name]) is not None


def resolve_report_to(report_to: list[str] | str | None) -> list[str]:
    """The trackers to open: ``report_to`` normalised, ``"all"`` as every tracker installed (TRL's meaning).

    Raises:
        ValueError: an unknown name, or a named tracker that is not installed, with the extra that installs it.
    """
    names = normalize_report_to(report_to)
    if "all" in names:
        names = list(dict.fromkeys([*(n for n in names if n != "all"), *(n for n in REPORT_TO if _installed(n))]))
    missing = [n for n in names if not _installed(n)]
    if missing:
        raise ValueError(f"report_to names {missing}, not installed here: pip install "
                         + " ".join(f"'asyncrl[{n}]'" for n in missing) + " (or leave it out of report_to)")
    return names


def step_metrics(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of a ``metrics.jsonl`` record, flat, under the same names (``pipeline.x`` as ``pipeline/x``), with
    the verdict as ``guard/accepted`` (1 or 0); strings, lists and per-worker counters are left out."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key not in _SKIP and isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = float(value)
    if isinstance(record.get("accepted"), bool):
        out["guard/accepted"] = float(record["accepted"])
    pipeline = record.get("pipeline") or {}
    for key, value in pipeline.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[f"pipeline/{key}"] = float(value)
    for key, value in (pipeline.get("weight_sync") or {}).items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[f"pipeline/weight_sync/{key}"] = float(value)
    return out


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


class Tracker(ABC):
    """One experiment tracker's run. Subclasses write through their library; :class:`Trackers` fans out."""

    name: str

    @abstractmethod
    def log_metrics(self, step: int, metrics: dict[str, float]) -> None: ...

    @abstractmethod
    def log_rejection(self, step: int, reason: str) -> None:
        """The update guard rejected the step's update, for ``reason``."""

    @abstractmethod
    def log_samples(self, step: int, columns: list[str], data: list[list[Any]]) -> None: ...

    @abstractmethod
    def log_summary(self, summary: dict[str, Any], text: str) -> None: ...

    @abstractmethod
    def state(self) -> dict[str, Any]:
        """What a resumed run needs to continue this tracker's run (kept in ``trackers.json``)."""

    @abstractmethod
    def location(self) -> str:
        """Where the run's data is, for the end-of-run summary."""

    @abstractmethod
    def close(self, ok: bool) -> None: ...


class TensorBoardTracker(Tracker):
    """Event files through ``torch.utils.tensorboard.SummaryWriter``.

    Args:
        log_dir: the log directory (one per run).
        config: the resolved config (logged as text).
        first_step: the first step this launch logs: events of earlier launches at this step or later (steps a
            resume rolled back, or an older run in the same directory) are purged from TensorBoard's view.
    """

    name = "tensorboard"

    def __init__(self, log_dir: str | os.PathLike, *, config: dict[str, Any], first_step: int):
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = str(log_dir)
        self.writer = SummaryWriter(self.log_dir, purge_step=first_step)
        self.writer.add_text("config", _code(orjson.dumps(config, option=orjson.OPT_INDENT_2).decode()), first_step)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def log_rejection(self, step: int, reason: str) -> None:
        self.writer.add_text("guard/rejection", reason, step)

    def log_samples(self, step: int, columns: list[str], data: list[list[Any]]) -> None:
        self.writer.add_text("samples", _markdown_table(columns, data), step)

    def log_summary(self, summary: dict[str, Any], text: str) -> None:
        self.writer.add_text("summary", _code(text), summary["steps"]["last"] or 0)

    def state(self) -> dict[str, Any]:
        return {"log_dir": self.log_dir}

    def location(self) -> str:
        return f"{self.log_dir} (tensorboard --logdir {self.log_dir})"

    def close(self, ok: bool) -> None:
        self.writer.close()


def _code(text: str) -> str:
    """Text shown verbatim by TensorBoard's Markdown renderer (indented four spaces: a code block)."""
    return "\n".join("    " + line for line in text.splitlines())


def _markdown_table(columns: list[str], data: list[list[Any]]) -> str:
    def cell(value: Any) -> str:
        text = "" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)
        return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", "\u23ce")  # one line per row

    head = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns)
    return head + "".join("\n| " + " | ".join(cell(v) for v in row) + " |" for row in data)


class WandbTracker(Tracker):
    """A Weights & Biases run (online, or offline with ``WANDB_MODE=offline``), stepped by ``train/global_step`` as
    transformers' integration does, so steps a resume redoes are logged again instead of dropped.

    Args:
        run_id: the run to continue (a resume), or None for a new one.
    """

    name = "wandb"

    def __init__(self, *, project: str, entity: str | None, name: str, run_dir: str | os.PathLike,
                 config: dict[str, Any], run_id: str | None):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=project, entity=entity, name=name, dir=str(run_dir), config=config, id=run_id,
                              resume="allow" if run_id else None)
        if run_id:  # a resumed launch may change keys (train.steps): its config is the one that holds now
            self.run.config.update(config, allow_val_change=True)
        self.run.define_metric("train/global_step")
        self.run.define_metric("*", step_metric="train/global_step", step_sync=True)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log({"train/global_step": step, **metrics})

    def log_rejection(self, step: int, reason: str) -> None:
        self.run.log({"train/global_step": step, "guard/rejection": reason})

    def log_samples(self, step: int, columns: list[str], data: list[list[Any]]) -> None:
        self.run.log({"train/global_step": step, "samples": self.wandb.Table(columns=columns, data=data)})

    def log_summary(self, summary: dict[str, Any], text: str) -> None:
        self.run.summary.update({"run_summary": summary, "verdict": summary["verdict"]})

    def state(self) -> dict[str, Any]:
        return {"id": self.run.id, "project": self.run.project}

    def location(self) -> str:
        if self.run.settings.mode == "offline":
            local = Path(self.run.dir).parent
            return f"{local} (offline: wandb sync {local})"
        return self.run.url or self.run.dir

    def close(self, ok: bool) -> None:
        self.run.finish(exit_code=0 if ok else 1)


class MlflowTracker(Tracker):
    """An MLflow run, through ``MlflowClient`` (no global active run: a loop's own ``mlflow.start_run`` is left
    alone).

    Args:
        uri: the tracking URI.
        artifact_location: where a new experiment keeps its artifacts (None: the server's default).
        run_id: the run to continue (a resume), or None for a new one.
    """

    name = "mlflow"

    def __init__(self, *, uri: str, artifact_location: str | None, experiment: str, name: str,
                 config: dict[str, Any], run_id: str | None):
        # log_table appends by downloading the table first, each time with a progress bar of its own that would cut
        # into the training loop's; the user's setting wins
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
        from mlflow import MlflowClient
        from mlflow.entities import Param

        self.uri = uri
        self.client = client = MlflowClient(tracking_uri=uri)
        found = client.get_experiment_by_name(experiment)
        self.experiment_id = (found.experiment_id if found is not None
                              else client.create_experiment(experiment, artifact_location=artifact_location))
        if run_id is None:
            run = client.create_run(self.experiment_id, run_name=name, tags={"asyncrl.run_dir": config.get("run_dir", "")})
            self.run_id, logged = run.info.run_id, {}
        else:
            self.run_id = run_id
            client.update_run(run_id, status="RUNNING")
            logged = client.get_run(run_id).data.params
        # a parameter's value cannot change in MLflow: a resumed launch logs only the keys it adds (config.json holds
        # the whole config of the latest launch)
        params = {k: str(v)[:MLFLOW_PARAM_CHARS] for k, v in _flatten(config).items()}
        new = [Param(k, v) for k, v in params.items() if k not in logged]
        for i in range(0, len(new), 100):  # MLflow takes at most 100 parameters per request
            client.log_batch(self.run_id, params=new[i:i + 100])
        client.log_dict(self.run_id, config, "config.json")

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()])

    def log_rejection(self, step: int, reason: str) -> None:
        self.client.log_table(self.run_id, {"step": [step], "reason": [reason]}, "guard_rejections.json")

    def log_samples(self, step: int, columns: list[str], data: list[list[Any]]) -> None:
        table = {c: [_finite(row[i]) for row in data] for i, c in enumerate(columns)}
        self.client.log_table(self.run_id, table, "samples.json")

    def log_summary(self, summary: dict[str, Any], text: str) -> None:
        self.client.log_dict(self.run_id, summary, "summary.json")
        self.client.set_tag(self.run_id, "verdict", summary["verdict"])

    def state(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "tracking_uri": self.uri, "experiment_id": self.experiment_id}

    def location(self) -> str:
        return f"{self.uri} run {self.run_id} (mlflow ui --backend-store-uri {self.uri})"

    def close(self, ok: bool) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if ok else "FAILED")


def _finite(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


class Trackers:
    """The trackers of one run (none: every call does nothing). Build with :meth:`open`."""

    def __init__(self, trackers: list[Tracker], run_dir: str | os.PathLike | None = None):
        self.trackers = trackers
        self.run_dir = Path(run_dir) if run_dir is not None else None
        if self.run_dir is not None and trackers:
            tmp = self.run_dir / f".{STATE_FILE}.tmp"
            tmp.write_bytes(orjson.dumps({t.name: t.state() for t in trackers}, option=orjson.OPT_INDENT_2))
            os.replace(tmp, self.run_dir / STATE_FILE)

    @classmethod
    def open(cls, report_to: list[str] | str | None, tracking: TrackingConfig, *, run_dir: str | os.PathLike,
             config: dict[str, Any], resume_step: int | None = None) -> Trackers:
        """Opens the trackers ``report_to`` names for the run in ``run_dir``.

        Args:
            config: the resolved config (plain data).
            resume_step: the step a resumed launch continues from: each tracker continues the run ``trackers.json``
                names; None: a fresh run (new tracker runs, the file rewritten).

        Raises:
            ValueError: a tracker that is not installed (:func:`resolve_report_to`).
        """
        names = resolve_report_to(report_to)
        run_dir = Path(run_dir)
        saved = {}
        if resume_step is not None and (run_dir / STATE_FILE).is_file():
            saved = orjson.loads((run_dir / STATE_FILE).read_bytes())
        name = tracking.run_name or run_dir.resolve().name
        opened: list[Tracker] = []
        try:
            for tracker in names:
                prior = saved.get(tracker, {})
                if tracker == "tensorboard":
                    log_dir = tracking.tensorboard_dir or prior.get("log_dir") or run_dir / "tensorboard"
                    opened.append(TensorBoardTracker(log_dir, config=config, first_step=(resume_step or 0) + 1))
                elif tracker == "wandb":
                    opened.append(WandbTracker(project=prior.get("project", tracking.project),
                                               entity=tracking.wandb_entity, name=name, run_dir=run_dir,
                                               config=config, run_id=prior.get("id")))
                else:
                    local = f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"  # artifacts beside it, not in the cwd
                    uri = (tracking.mlflow_tracking_uri or prior.get("tracking_uri")
                           or os.environ.get("MLFLOW_TRACKING_URI") or local)
                    opened.append(MlflowTracker(uri=uri, experiment=tracking.project, name=name, config=config,
                                                run_id=prior.get("run_id"),
                                                artifact_location=(run_dir / "mlartifacts").resolve().as_uri()
                                                if uri == local else None))
        except BaseException:
            for t in opened:  # what was opened is closed, as failed: no run is left "running" in a tracker
                t.close(ok=False)
            raise
        return cls(opened, run_dir)

    def log_step(self, step: int, record: dict[str, Any]) -> None:
        """A ``metrics.jsonl`` record: its numbers, and the guard's reason when it rejected the update."""
        if not self.trackers:
            return
        metrics = step_metrics(record)
        for t in self.trackers:
            t.log_metrics(step, metrics)
            if record.get("accepted") is False:
                t.log_rejection(step, record.get("guard_reason") or "")

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Sample rows (:mod:`asyncrl.debug.samples`) as one table."""
        if not self.trackers or not rows:
            return
        columns, data = table_columns(rows)
        for t in self.trackers:
            t.log_samples(step, columns, data)

    def log_summary(self, summary: dict[str, Any], text: str) -> None:
        """The end-of-run summary (:func:`asyncrl.debug.summary.run_summary`) and its text."""
        for t in self.trackers:
            t.log_summary(summary, text)

    def locations(self) -> dict[str, str]:
        """``{tracker: where its run is}``."""
        return {t.name: t.location() for t in self.trackers}

    def close(self, ok: bool = True) -> None:
        """Ends every tracker's run (``ok=False``: as failed)."""
        for t in self.trackers:
            t.close(ok)
        self.trackers = []

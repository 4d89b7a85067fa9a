"""What a run did, said at its end: ``run_dir/summary.json`` and the lines the recipe prints last.

:func:`run_summary` reads the run's records (``metrics.jsonl``, required; ``config.json``, ``debug/anomalies.jsonl``,
``samples.jsonl`` when present) and returns one dict: steps, the update guard's verdicts (accepted, rejected and why,
with the fix), reward over the first and the last window of steps, staleness, throughput, the pipeline's counters,
the debugger's anomalies, and where the outputs are. Its ``verdict`` is ``"ok"``, ``"most updates rejected"`` or
``"every update rejected"`` (judged on the steps of this launch: a resumed run is judged on what it did), and the
recipe exits non-zero on the last. :func:`format_summary` is the text for a terminal, :func:`write_summary` writes
the JSON atomically. :class:`GuardWatch` says the same while the run goes: the progress bar's counts, a line at the
first rejection and a warning when most of the recent updates were rejected.

Offline readers of finished or live runs: nothing here waits on anything; ``asyncrl report`` shows the same
numbers.
"""

from __future__ import annotations

import math
import os
from collections import Counter, deque
from pathlib import Path
from typing import Any

import orjson

from asyncrl.debug._jsonl import last_per_step, read_jsonl

__all__ = ["SUMMARY_FILE", "GuardWatch", "alarm", "format_summary", "rejection_fix", "rejection_kind", "reward_window",
           "run_summary", "write_summary"]

SUMMARY_FILE = "summary.json"
PIPELINE_KEYS = ("stale_dropped", "regenerated", "rollouts_received", "bad_messages")


def rejection_kind(reason: str) -> str:
    """The class of a guard rejection: ``non-finite``, ``grad_norm``, ``update_ratio`` (the guard's reasons start
    with these), else ``other``."""
    if reason.startswith("non-finite"):
        return "non-finite"
    head = reason.split("=", 1)[0]
    return head if head in ("grad_norm", "update_ratio") else "other"


def rejection_fix(kind: str, config: dict[str, Any] | None = None) -> str:
    """What to change for a class of rejections, with the run's values when its config is known."""
    cfg = config or {}
    lr = (cfg.get("train") or {}).get("lr", "?")
    guard = cfg.get("guard") or {}
    if kind == "update_ratio":
        return (f"each rejected step moved the trained parameters by more than guard.max_update_ratio="
                f"{guard.get('max_update_ratio', '?')} of their norm: lower train.lr (now {lr}) or raise "
                "guard.max_update_ratio")
    if kind == "grad_norm":
        return (f"the gradient norm exceeded guard.max_grad_norm={guard.get('max_grad_norm', '?')}: raise it (null: "
                f"only non-finite norms are rejected) or lower train.lr (now {lr})")
    if kind == "non-finite":
        return "a NaN or inf reward, loss or gradient: replay the dumped batch with `asyncrl replay DUMP --checkpoint CKPT`"
    return "see the guard's reasons in metrics.jsonl (guard_reason)"


def reward_window(steps: int) -> int:
    """Steps averaged at each end of the reward curve: a fifth of the run, between 1 and 20."""
    return max(1, min(20, steps // 5))


def _mean(values: list[Any]) -> float | None:
    finite = [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return sum(finite) / len(finite) if finite else None


def _updates(rows: list[dict[str, Any]], config: dict[str, Any] | None) -> dict[str, Any]:
    rejected = [r for r in rows if r.get("accepted") is False]
    by_kind: dict[str, dict[str, Any]] = {}
    for r in rejected:
        reason = r.get("guard_reason") or ""
        entry = by_kind.setdefault(rejection_kind(reason), {"count": 0, "first_step": r.get("step"), "example": reason})
        entry["count"] += 1
    for kind, entry in by_kind.items():
        entry["fix"] = rejection_fix(kind, config)
    return {"accepted": sum(r.get("accepted") is True for r in rows), "rejected": len(rejected), "rejected_by": by_kind}


def _reward(rows: list[dict[str, Any]]) -> dict[str, Any]:
    w = reward_window(len(rows))
    first, last = rows[:w], rows[-w:]
    names = sorted({k for r in rows for k in r if k.startswith("rewards/") and k.endswith("/mean")})
    out = {"window": w, "first": _mean([r.get("reward_mean") for r in first]),
           "last": _mean([r.get("reward_mean") for r in last]),
           "components": {n.removeprefix("rewards/").removesuffix("/mean"): {
               "first": _mean([r.get(n) for r in first]), "last": _mean([r.get(n) for r in last])} for n in names}}
    out["change"] = None if out["first"] is None or out["last"] is None else out["last"] - out["first"]
    return out


def _staleness(rows: list[dict[str, Any]]) -> dict[str, Any]:
    hists = [r["staleness_hist"] for r in rows if isinstance(r.get("staleness_hist"), list)]
    width = max((len(h) for h in hists), default=0)
    hist = [sum(h[i] for h in hists if i < len(h)) for i in range(width)]
    top = [r.get("staleness_max") for r in rows if isinstance(r.get("staleness_max"), (int, float))]
    return {"mean": _mean([r.get("staleness_mean") for r in rows]), "max": max(top) if top else None, "hist": hist}


def _throughput(rows: list[dict[str, Any]]) -> dict[str, Any]:
    step_s = [r.get("step_s") for r in rows]
    total_s = sum(v for v in step_s if isinstance(v, (int, float)))
    rollouts = sum(r["rollouts_per_s"] * r["step_s"] for r in rows
                   if isinstance(r.get("rollouts_per_s"), (int, float)) and isinstance(r.get("step_s"), (int, float)))
    tokens = sum(r.get("tokens") or 0 for r in rows)
    wait = sum(r.get("wait_s") or 0 for r in rows)
    return {"train_s": total_s, "rollouts": round(rollouts), "rollouts_per_s": rollouts / total_s if total_s else None,
            "tokens_per_s": tokens / total_s if total_s else None,
            "trainer_wait_fraction": wait / total_s if total_s else None}


def _anomalies(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / "debug" / "anomalies.jsonl"
    if not path.is_file():
        return None if not (run_dir / "debug").is_dir() else {"total": 0, "by_kind": {}}
    lines = read_jsonl(path)
    by_kind: dict[str, dict[str, Any]] = {}
    for a in lines:
        entry = by_kind.setdefault(a.get("kind", "?"), {"count": 0, "first_step": a.get("step"), "rank": a.get("rank"),
                                                        "detail": a.get("detail"), "dump": a.get("dump"),
                                                        "samples": a.get("samples")})
        entry["count"] += 1
    return {"total": len(lines), "by_kind": by_kind}


def _samples(run_dir: Path) -> dict[str, Any] | None:
    rows = read_jsonl(run_dir / "samples.jsonl")  # asyncrl.debug.samples.SAMPLES_FILE (that module imports torch)
    if not rows:
        return None
    return {"file": "samples.jsonl", "rollouts": len(rows), "steps": sorted({r.get("step") for r in rows}),
            "anomaly_rollouts": sum(r.get("why") == "anomaly" for r in rows)}


def _verdict(updates: dict[str, Any]) -> str:
    total = updates["accepted"] + updates["rejected"]
    if not total:
        return "no step"
    if updates["accepted"] == 0:
        return "every update rejected"
    return "most updates rejected" if updates["rejected"] * 2 > total else "ok"


def run_summary(run_dir: str | os.PathLike, *, launch_from_step: int = 0,
                outputs: dict[str, str] | None = None, failed: str | None = None) -> dict[str, Any]:
    """The summary of the run in ``run_dir`` (see the module docstring).

    Args:
        launch_from_step: the step this launch resumed from (0: a fresh run); the verdict is on the later steps.
        outputs: ``{name: path}`` of outputs besides the records found in ``run_dir`` (trackers, the report).
        failed: the error a failed launch ended with (its summary says what it did until then, and that it failed).

    Raises:
        ValueError: ``run_dir`` has no ``metrics.jsonl``.
    """
    run_dir = Path(run_dir)
    if not (run_dir / "metrics.jsonl").is_file():
        raise ValueError(f"no {run_dir / 'metrics.jsonl'}: is {str(run_dir)!r} the run_dir of a recipes/grpo.py run?")
    rows = last_per_step(read_jsonl(run_dir / "metrics.jsonl"))
    config_path = run_dir / "config.json"
    config = orjson.loads(config_path.read_bytes()) if config_path.is_file() else None
    launch = [r for r in rows if (r.get("step") or 0) > launch_from_step]
    updates = _updates(rows, config)
    updates["this_launch"] = {k: v for k, v in _updates(launch, config).items() if k != "rejected_by"}
    found = {name: str(run_dir / rel) for name, rel in (
        ("metrics", "metrics.jsonl"), ("samples", "samples.jsonl"), ("summary", SUMMARY_FILE), ("debugger", "debug"),
        ("dumps", "dumps"), ("report", "report/index.html"), ("config", "config.json")) if (run_dir / rel).exists()
        or rel == SUMMARY_FILE}
    latest = run_dir / "checkpoints" / "latest"
    if latest.is_file():
        found["checkpoint"] = str(run_dir / "checkpoints" / latest.read_text().strip())
    return {
        "run_dir": str(run_dir),
        "verdict": _verdict(updates["this_launch"]),
        "failed": failed,
        "steps": {"total": len(rows), "first": rows[0].get("step") if rows else None,
                  "last": rows[-1].get("step") if rows else None, "this_launch": len(launch),
                  "resumed_from": launch_from_step or None},
        "updates": updates,
        "reward": _reward(rows),
        "staleness": _staleness(rows),
        "throughput": _throughput(rows),
        "pipeline": {k: (rows[-1].get("pipeline") or {}).get(k) for k in PIPELINE_KEYS} if rows else {},
        "anomalies": _anomalies(run_dir),
        "samples": _samples(run_dir),
        "outputs": {**found, **(outputs or {})},
    }


def write_summary(run_dir: str | os.PathLike, summary: dict[str, Any]) -> Path:
    """``run_dir/summary.json``, written atomically (temp file, then ``os.replace``)."""
    path = Path(run_dir) / SUMMARY_FILE
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))
    os.replace(tmp, path)
    return path


def _f(value: Any, spec: str = ".3f") -> str:
    return "n/a" if value is None else format(value, spec)


def alarm(summary: dict[str, Any]) -> str | None:
    """The loud lines for a run whose updates were mostly or all rejected; None for the others."""
    verdict = summary["verdict"]
    if verdict not in ("most updates rejected", "every update rejected"):
        return None
    launch = summary["updates"]["this_launch"]
    total = launch["accepted"] + launch["rejected"]
    kinds = summary["updates"]["rejected_by"]
    why = "; ".join(f"{k} x{e['count']} (first at step {e['first_step']}: {e['example']})" for k, e in kinds.items())
    fixes = " ".join(f"Fix ({k}): {e['fix']}." for k, e in kinds.items())
    head = "EVERY UPDATE WAS REJECTED" if verdict == "every update rejected" else "MOST UPDATES WERE REJECTED"
    bar = "!" * 100
    return (f"{bar}\n!! {head}: {launch['rejected']} of {total} updates of this run were rejected by the update guard,"
            f" so the policy {'never' if launch['accepted'] == 0 else 'barely'} trained.\n!! Why: {why}\n!! {fixes}\n{bar}")


def format_summary(summary: dict[str, Any]) -> str:
    """The summary as a few aligned lines for a terminal (the alarm first, when there is one)."""
    s, u, rw, st, tp = (summary[k] for k in ("steps", "updates", "reward", "staleness", "throughput"))
    lines = [f"== run summary: {summary['run_dir']} =="]
    if summary.get("failed"):
        lines.append(f"FAILED      {summary['failed']} (what it did until then:)")
    resumed = f", this launch {s['this_launch']} (resumed from step {s['resumed_from']})" if s["resumed_from"] else ""
    lines.append(f"steps       {s['total']} ({s['first']}..{s['last']}){resumed}")
    kinds = ", ".join(f"{k} x{e['count']}, first at step {e['first_step']}: {e['example']}"
                      for k, e in u["rejected_by"].items())
    lines.append(f"updates     {u['accepted']} accepted, {u['rejected']} rejected" + (f" ({kinds})" if kinds else ""))
    parts = [f"{_f(rw['first'])} (first {rw['window']} steps) -> {_f(rw['last'])} (last {rw['window']} steps)"]
    if rw["change"] is not None:
        parts[0] += f", {rw['change']:+.3f}"
    parts += [f"{n} {_f(c['first'])} -> {_f(c['last'])}" for n, c in rw["components"].items()]
    lines.append("reward      " + "; ".join(parts))
    lines.append(f"staleness   mean {_f(st['mean'], '.2f')}, max {_f(st['max'], '.0f')}")
    lines.append(f"throughput  {tp['rollouts']:,} rollouts in {tp['train_s']:.1f} s of steps: "
                 f"{_f(tp['rollouts_per_s'], ',.1f')} rollouts/s, {_f(tp['tokens_per_s'], ',.0f')} tokens/s; "
                 f"the trainer waited for rollouts {_f(tp['trainer_wait_fraction'], '.0%')} of the time")
    if summary["pipeline"]:
        lines.append("pipeline    " + ", ".join(f"{k} {v}" for k, v in summary["pipeline"].items() if v is not None))
    an = summary["anomalies"]
    if an is None:
        lines.append("anomalies   not checked (debug.enabled=false)")
    elif not an["total"]:
        lines.append("anomalies   none")
    else:
        lines.append(f"anomalies   {an['total']}: " + "; ".join(
            f"{k} x{e['count']} (first at step {e['first_step']}, rank {e['rank']}"
            + (f", {e['dump']}" if e.get("dump") else "") + ")" for k, e in an["by_kind"].items()))
    sm = summary["samples"]
    if sm:
        lines.append(f"samples     {sm['file']}: {sm['rollouts']} rollouts of {len(sm['steps'])} steps"
                     + (f" ({sm['anomaly_rollouts']} from anomalies' batches)" if sm["anomaly_rollouts"] else ""))
    lines += [f"{'outputs' if i == 0 else '':<12}{name}: {path}" for i, (name, path) in enumerate(summary["outputs"].items())]
    text = "\n".join(lines)
    loud = alarm(summary)
    return f"{loud}\n{text}\n{loud}" if loud else text


class GuardWatch:
    """The update guard's verdicts as the run goes: counts for the progress bar, and the lines worth printing.

    Args:
        window: how many recent verdicts the warning looks at.
        config: the run's config as a dict (the fix names its values).
    """

    def __init__(self, window: int = 10, config: dict[str, Any] | None = None):
        self.window, self.config = window, config
        self.accepted = self.rejected = 0
        self.kinds: Counter[str] = Counter()
        self._recent: deque[bool] = deque(maxlen=window)
        self._warned_at = -window

    def observe(self, step: int, accepted: bool, reason: str) -> str | None:
        """Counts a verdict; returns a line to print: the first rejection, or a warning (at most once per window)
        when more than half of the last ``window`` updates were rejected."""
        self._recent.append(accepted)
        if accepted:
            self.accepted += 1
            return None
        self.rejected += 1
        kind = rejection_kind(reason)
        self.kinds[kind] += 1
        if self.rejected == 1:
            return f"step {step}: the update guard rejected the update ({reason}); the policy did not move"
        bad = self._recent.count(False)
        if len(self._recent) == self.window and bad * 2 > self.window and step - self._warned_at >= self.window:
            self._warned_at = step
            return (f"WARNING step {step}: {bad} of the last {self.window} updates were rejected by the update guard "
                    f"({', '.join(f'{k} x{n}' for k, n in self.kinds.items())} so far): "
                    f"{rejection_fix(kind, self.config)}")
        return None

    def postfix(self) -> dict[str, int]:
        """``{"accepted": a, "rejected": r}`` for the progress bar."""
        return {"accepted": self.accepted, "rejected": self.rejected}

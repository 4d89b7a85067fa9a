"""The end-of-run summary (asyncrl.debug.summary): what it counts from a run's records, its verdict on a run whose
updates were mostly or all rejected (judged on this launch's steps), the fix it names, and the guard's lines while
the run goes."""

from __future__ import annotations

import json

import orjson
import pytest

from asyncrl.debug.summary import (GuardWatch, format_summary, rejection_kind, reward_window, run_summary,
                                   write_summary)
from tests._synthetic_run import ANOMALIES, REJECTED_STEP, make_run

RATIO = "update_ratio=0.2 > guard.max_update_ratio=0.05"


def _rewrite(run, change) -> None:
    rows = [orjson.loads(line) for line in (run / "metrics.jsonl").read_bytes().splitlines()]
    for r in rows:
        change(r)
    (run / "metrics.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))


def test_a_healthy_runs_summary(tmp_path):
    run = make_run(tmp_path / "run", steps=40)
    s = run_summary(run, outputs={"tracker wandb": "somewhere"})
    assert s["verdict"] == "ok" and s["steps"] == {"total": 40, "first": 1, "last": 40, "this_launch": 40,
                                                   "resumed_from": None}
    assert s["updates"]["accepted"] == 39 and s["updates"]["rejected"] == 1
    rejected = s["updates"]["rejected_by"]["update_ratio"]
    assert rejected["count"] == 1 and rejected["first_step"] == REJECTED_STEP
    assert "lower train.lr (now 0.001) or raise guard.max_update_ratio" in rejected["fix"]
    assert s["reward"]["window"] == 8 and s["reward"]["last"] > s["reward"]["first"]
    assert s["staleness"]["max"] == 2 and len(s["staleness"]["hist"]) == 17
    assert s["throughput"]["rollouts"] > 0 and 0 < s["throughput"]["trainer_wait_fraction"] < 1
    assert s["anomalies"]["total"] == len(ANOMALIES) and s["anomalies"]["by_kind"]["logprob_spike"]["samples"] == {
        "file": "samples.jsonl", "step": 9, "rank": 0}
    assert s["samples"]["rollouts"] == 56 and s["samples"]["anomaly_rollouts"] == 16
    assert s["outputs"]["tracker wandb"] == "somewhere" and s["outputs"]["samples"].endswith("samples.jsonl")
    text = format_summary(s)
    assert "39 accepted, 1 rejected" in text and "REJECTED" not in text and "logprob_spike x1" in text
    assert json.loads(write_summary(run, s).read_text()) == json.loads(json.dumps(s))


@pytest.mark.parametrize("accepted_steps, verdict", [(set(), "every update rejected"), ({1, 2, 3}, "most updates rejected"),
                                                     ({1, 2, 3, 4, 5}, "ok")])
def test_the_verdict_on_rejected_updates_is_loud(tmp_path, accepted_steps, verdict):
    run = make_run(tmp_path / "run", steps=10, debug=False)
    _rewrite(run, lambda r: r.update(accepted=r["step"] in accepted_steps,
                                     guard_reason="" if r["step"] in accepted_steps else RATIO))
    s = run_summary(run)
    assert s["verdict"] == verdict
    text = format_summary(s)
    if verdict == "ok":
        assert "!!" not in text
    else:
        head = "EVERY UPDATE WAS REJECTED" if not accepted_steps else "MOST UPDATES WERE REJECTED"
        assert text.startswith("!" * 100) and text.count(head) == 2  # first and last: it cannot be missed
        assert f"{10 - len(accepted_steps)} of 10 updates" in text and "guard.max_update_ratio=0.05" in text


def test_a_resumed_launch_is_judged_on_its_own_steps(tmp_path):
    run = make_run(tmp_path / "run", steps=10, debug=False)
    _rewrite(run, lambda r: r.update(accepted=r["step"] <= 6, guard_reason="" if r["step"] <= 6 else RATIO))
    s = run_summary(run, launch_from_step=6)  # steps 7-10 were this launch's, all rejected
    assert s["verdict"] == "every update rejected" and s["updates"]["this_launch"] == {"accepted": 0, "rejected": 4}
    assert s["updates"]["accepted"] == 6 and s["steps"]["resumed_from"] == 6
    assert "resumed from step 6" in format_summary(s)
    assert run_summary(run, launch_from_step=10)["verdict"] == "no step"


def test_rejection_kinds_and_windows():
    assert rejection_kind("non-finite loss=nan or grad_norm=nan") == "non-finite"
    assert rejection_kind("grad_norm=12 > guard.max_grad_norm=5") == "grad_norm"
    assert rejection_kind(RATIO) == "update_ratio" and rejection_kind("my own check") == "other"
    assert [reward_window(n) for n in (1, 4, 40, 150, 10_000)] == [1, 1, 8, 20, 20]


def test_the_guard_watch_says_the_first_rejection_and_warns_when_most_are_rejected():
    watch = GuardWatch(window=10, config={"train": {"lr": 0.01}, "guard": {"max_update_ratio": 0.05}})
    said = {step: watch.observe(step, accepted=step % 4 == 0, reason="" if step % 4 == 0 else RATIO)
            for step in range(1, 31)}
    lines = {step: line for step, line in said.items() if line}
    assert lines[1].startswith("step 1: the update guard rejected the update (update_ratio=")
    warnings = [step for step, line in lines.items() if line.startswith("WARNING")]
    assert warnings == [10, 21]  # a full window, more than half rejected; then at most once per window
    assert "lower train.lr (now 0.01)" in lines[10] and "8 of the last 10" in lines[10]
    assert watch.postfix() == {"accepted": 7, "rejected": 23}
    quiet = GuardWatch()
    assert [quiet.observe(s, s % 3 != 0, RATIO) for s in range(1, 31)].count(None) == 29  # only the first rejection


def test_no_metrics_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="metrics.jsonl"):
        run_summary(tmp_path)


def test_a_failed_run_ends_with_the_summary_of_what_it_did_marked_failed(tmp_path, capsys):
    # rank 0 of a run that failed mid-way: abort() closes what was started, writes summary.json marked failed, prints
    # it after the error line, and ends the trackers' runs as failed (without a process group: abort needs none)
    from types import SimpleNamespace

    from asyncrl.integrations.trackers import Trackers
    from recipes.grpo import GRPORecipe

    class Tracker:
        name, ended = "fake", None

        def log_summary(self, summary, text):
            self.summary = summary

        def location(self):
            return "nowhere"

        def close(self, ok):
            self.ended = "ok" if ok else "failed"

    tracker = Tracker()
    recipe = GRPORecipe.__new__(GRPORecipe)
    recipe.rank, recipe.launch_from = 0, 0
    recipe.run_dir = make_run(tmp_path / "run", steps=30)
    recipe.cfg = SimpleNamespace(debug=SimpleNamespace(report=False))
    recipe.metrics_file = open(recipe.run_dir / "metrics.jsonl", "a")  # noqa: SIM115 (abort closes it)
    recipe.trackers = Trackers([tracker])
    recipe.abort(RuntimeError("the reward server went away\nmore lines"))
    err = capsys.readouterr().err
    assert err.index("[rank 0] grpo failed: RuntimeError: the reward server went away") < err.index("== run summary")
    assert "FAILED      RuntimeError: the reward server went away" in err and "steps       30 (1..30)" in err
    written = json.loads((recipe.run_dir / "summary.json").read_text())
    assert written["failed"] == "RuntimeError: the reward server went away" and written["steps"]["total"] == 30
    assert tracker.ended == "failed" and tracker.summary["failed"] and recipe.metrics_file.closed

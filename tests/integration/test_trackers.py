"""The experiment trackers, offline, read back with each tracker's own reader: TensorBoard's event accumulator, the
W&B offline run's transaction log (``wandb leet inspect --json``, W&B's reader) and table files, MLflow's
``search_runs`` over a local SQLite store. One run of four steps (a rejected update, two samples tables, hostile
text), then a resume from step 2: the same tracker runs continue. Nothing reaches the network: W&B is offline,
MLflow's store is a file, and every tracker's telemetry is off."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.config import TrackingConfig
from asyncrl.integrations.trackers import STATE_FILE, Trackers, resolve_report_to

pytestmark = [pytest.mark.integration]

TRACKERS = ("tensorboard", "wandb", "mlflow")
OFFLINE = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true", "WANDB_CONSOLE": "off",
           "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "1"}
"""What a test sets so that no tracker reaches the network (tests/integration/test_recipe_outputs.py too)."""
HOSTILE = "a | b\n</td><script>alert(1)</script>"


def _missing() -> list[str]:
    import importlib.util

    return [t for t in TRACKERS if importlib.util.find_spec(t) is None]


@pytest.fixture
def offline(monkeypatch):
    """The network-free settings; the working directory is left as it was (mlflow's default store is a file there)."""
    if missing := _missing():
        pytest.skip(f"needs the tracker extras: pip install " + " ".join(f"'asyncrl[{m}]'" for m in missing))
    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def _record(step: int, reward: float, accepted: bool = True) -> dict:
    return {"step": step, "time": 1.0, "accepted": accepted, "policy_version": step,
            "guard_reason": "" if accepted else "update_ratio=0.3 > guard.max_update_ratio=0.05",
            "reward_mean": reward, "loss": 0.1, "update_ratio": 0.3 if not accepted else 0.01,
            "staleness_hist": [1, 2], "rewards/arithmetic/mean": reward,
            "pipeline": {"stale_dropped": step, "workers": {"w0": {"busy_s": 1.0}}, "weight_sync": {"bytes_served": 10}}}


def _rows(step: int, completion: str) -> list[dict]:
    return [{"step": step, "rank": 0, "uid": f"e0-p{step}-s{i}", "prompt": "3+4=", "completion": completion,
             "reward": 1.0, "rewards": {"arithmetic": 1.0}, "advantage": 0.5, "rollout_logprob": -0.4,
             "response_tokens": 2, "finish_reason": "stop", "policy_version": step - 1, "staleness": 1,
             "accepted": True} for i in range(2)]


def _launch(run_dir: Path, steps: range, resume_step: int | None, config: dict) -> Trackers:
    trackers = Trackers.open(list(TRACKERS), TrackingConfig(project="asyncrl-test"), run_dir=run_dir, config=config,
                             resume_step=resume_step)
    for step in steps:
        launch = 1 if resume_step is None else 2
        trackers.log_step(step, _record(step, reward=step + launch / 10, accepted=step != 3 or launch == 2))
        if step % 2 == 0:
            trackers.log_samples(step, _rows(step, HOSTILE if launch == 1 else f"launch {launch}"))
    trackers.log_summary({"verdict": "ok", "steps": {"last": steps[-1]}}, "== run summary ==\nsteps 4")
    return trackers


def _wandb_records(path: Path) -> list[dict]:
    wandb = shutil.which("wandb", path=str(Path(sys.executable).parent)) or "wandb"
    out = subprocess.run([wandb, "leet", "inspect", "--json", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def test_each_tracker_holds_the_steps_the_samples_and_the_verdicts_and_a_resume_continues_its_run(tmp_path, offline):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = {"run_dir": str(run_dir), "train": {"lr": 0.001, "steps": 4}, "report_to": list(TRACKERS)}
    first = _launch(run_dir, range(1, 5), None, config)
    where = first.locations()
    first.close(ok=True)
    state = json.loads((run_dir / STATE_FILE).read_text())
    assert set(state) == set(TRACKERS)
    second = _launch(run_dir, range(3, 6), 2, {**config, "train": {"lr": 0.001, "steps": 5}})
    second.close(ok=True)
    assert json.loads((run_dir / STATE_FILE).read_text()) == state  # the same runs, continued
    assert set(where) == set(TRACKERS) and "wandb sync" in where["wandb"]

    # TensorBoard, read as its UI reads it (the plugin event accumulator): the resumed launch purged steps >= 3 of
    # the first, so each step is there once, with the second launch's values
    from tensorboard.backend.event_processing import plugin_event_accumulator as pea
    from tensorboard.util.tensor_util import make_ndarray

    acc = pea.EventAccumulator(str(run_dir / "tensorboard"), size_guidance={pea.TENSORS: 0})
    acc.Reload()
    read = lambda tag: [(e.step, make_ndarray(e.tensor_proto).item()) for e in acc.Tensors(tag)]  # noqa: E731
    assert [(s, round(v, 3)) for s, v in read("reward_mean")] == [(1, 1.1), (2, 2.1), (3, 3.2), (4, 4.2), (5, 5.2)]
    assert [v for _, v in read("guard/accepted")] == [1, 1, 1, 1, 1]  # step 3's rejection was purged with it
    assert not read("guard/rejection/text_summary")
    assert {"pipeline/stale_dropped", "pipeline/weight_sync/bytes_served", "rewards/arithmetic/mean"} <= set(
        acc.Tags()["tensors"])
    samples = [(s, v.decode()) for s, v in read("samples/text_summary")]
    assert [s for s, _ in samples] == [2, 4]  # step 2 of the first launch, step 4 of the second
    assert "\\|" in samples[0][1] and "<script>" in samples[0][1] and "launch 2" in samples[1][1]
    assert "3+4=" in samples[0][1] and samples[0][1].count("\n| ") == 2  # a header and two rows, one line each
    assert '"lr": 0.001' in read("config/text_summary")[-1][1].decode()

    # W&B: two offline runs of one run id, the second resumed; history, config, tables, rejections, summary
    runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and len({r.name.rsplit("-", 1)[1] for r in runs}) == 1
    launches = [_wandb_records(next(r.glob("run-*.wandb"))) for r in runs]
    heads = [next(x["run"] for x in recs if x["type"] == "run") for recs in launches]
    assert heads[0]["run_id"] == heads[1]["run_id"] == state["wandb"]["id"] and heads[1].get("resume") is True
    assert heads[0]["config"]["update"]["train"] == {"lr": 0.001, "steps": 4}
    history = [[x["history"]["item"] for x in recs if x["type"] == "history"] for recs in launches]
    steps = [[h["train/global_step"] for h in hist if "reward_mean" in h] for hist in history]
    assert steps == [[1, 2, 3, 4], [3, 4, 5]]
    assert [h["guard/rejection"] for h in history[0] if "guard/rejection" in h] == [
        "update_ratio=0.3 > guard.max_update_ratio=0.05"]
    tables = sorted((runs[0] / "files" / "media" / "table").glob("samples_*.table.json"))
    assert len(tables) == 2
    table = json.loads(tables[0].read_text())
    assert table["columns"][:5] == ["step", "rank", "uid", "prompt", "completion"]
    assert table["data"][0][4] == HOSTILE and "reward/arithmetic" in table["columns"]
    summaries = [x["summary"]["update"] for x in launches[1] if x["type"] == "summary"]
    assert any(s.get("verdict") == "ok" for s in summaries)

    # MLflow: one run, finished, every launch's metrics (redone steps logged again), params, both tables
    import mlflow

    mlflow.set_tracking_uri(state["mlflow"]["tracking_uri"])  # the run's store (unset, mlflow would make one here)
    client = mlflow.MlflowClient()
    assert state["mlflow"]["tracking_uri"].startswith("sqlite:///") and str(run_dir) in state["mlflow"]["tracking_uri"]
    found = mlflow.search_runs(experiment_names=["asyncrl-test"], output_format="list")
    assert [r.info.run_id for r in found] == [state["mlflow"]["run_id"]] and found[0].info.status == "FINISHED"
    history = client.get_metric_history(found[0].info.run_id, "reward_mean")
    assert [(m.step, round(m.value, 3)) for m in history] == [(1, 1.1), (2, 2.1), (3, 3.1), (4, 4.1), (3, 3.2),
                                                               (4, 4.2), (5, 5.2)]
    assert found[0].data.params["train.lr"] == "0.001" and found[0].data.tags["verdict"] == "ok"
    local = Path(client.download_artifacts(found[0].info.run_id, "", str(tmp_path / "artifacts")))
    table = json.loads((local / "samples.json").read_text())
    assert table["columns"][:5] == ["step", "rank", "uid", "prompt", "completion"]
    assert [row[0] for row in table["data"]] == [2, 2, 4, 4, 4, 4]  # appended by each launch
    assert table["data"][0][4] == HOSTILE
    assert json.loads((local / "guard_rejections.json").read_text())["data"] == [
        [3, "update_ratio=0.3 > guard.max_update_ratio=0.05"]]
    assert json.loads((local / "config.json").read_text())["train"]["steps"] == 5  # the latest launch's
    assert (run_dir / "mlartifacts").is_dir()  # artifacts beside the store, not in the working directory


def test_report_to_names_the_extra_of_a_tracker_that_is_not_installed(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ValueError, match=r"pip install 'asyncrl\[wandb\]'"):
        resolve_report_to(["tensorboard", "wandb"])
    assert "wandb" not in resolve_report_to("all")  # TRL's "all": the trackers installed
    assert resolve_report_to("none") == [] and resolve_report_to(None) == []

"""What a recipe run says about itself, in two launches of ``recipes/grpo.py`` (2 gloo ranks, real HF workers):

1. four steps with samples every two steps and every tracker (offline): the progress bar counts the guard's
   verdicts, the run ends with its summary (printed, ``summary.json``), ``samples.jsonl`` holds readable rollouts,
   the report shows them as a table, and each tracker holds the step metrics and a samples table;
2. ``--resume`` to step 6 with a guard that rejects every update: the run exits non-zero, says so loudly, the
   debugger's dumps of the rejected batches point to their samples, and every tracker continues the first launch's
   run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_trackers import OFFLINE, TRACKERS, _missing, _wandb_records

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).parents[2]
CONFIG = ROOT / "recipes" / "configs" / "tiny_cpu.yaml"
SMALL = ["data.num_prompts=64", "rollout.batch_size=4", "rollout.group_size=4", "train.sft_steps=20",
         "checkpoint.every=2", "debug.samples_every=2", f"report_to=[{','.join(TRACKERS)}]"]


def _run(run_dir: Path, *overrides: str, resume: bool = False) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
            str(ROOT / "recipes" / "grpo.py"), *(["--resume"] if resume else []), "--config", str(CONFIG),
            f"run_dir={run_dir}", *SMALL, *overrides]
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env.update(OFFLINE, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900, cwd=run_dir.parent)


def test_a_run_says_what_it_did_and_a_run_of_rejected_updates_fails(tmp_path):
    if missing := _missing():
        pytest.skip("needs the tracker extras: pip install " + " ".join(f"'asyncrl[{m}]'" for m in missing))
    run = tmp_path / "run"
    first = _run(run, "train.steps=4", "debug.report=true")
    out = first.stdout + first.stderr
    assert first.returncode == 0, out[-4000:]

    # the progress bar counts the verdicts; the summary is the last thing printed, and written
    assert re.search(r"accepted=4, rejected=0", out), out[-3000:]
    printed = out[out.rindex("== run summary"):]
    assert "updates     4 accepted, 0 rejected" in printed and "samples     samples.jsonl" in printed
    summary = json.loads((run / "summary.json").read_text())
    assert summary["verdict"] == "ok" and summary["steps"]["total"] == 4
    assert summary["updates"]["accepted"] == 4 and summary["reward"]["first"] is not None
    assert summary["anomalies"] == {"total": 0, "by_kind": {}}
    assert {"metrics", "samples", "report", "checkpoint", *(f"tracker {t}" for t in TRACKERS)} <= set(summary["outputs"])

    # samples: steps 1, 2 and 4 (the last), 8 rollouts each per rank, decoded with the run's tokenizer
    rows = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert sorted({(r["step"], r["rank"]) for r in rows}) == [(s, r) for s in (1, 2, 4) for r in (0, 1)]
    assert len(rows) == 6 * 8 and all(r["why"] == "every" for r in rows)
    for r in rows:
        assert re.fullmatch(r"\d\+\d=", r["prompt"]), r  # the arithmetic task's prompt, as text
        assert isinstance(r["completion"], str) and r["response_tokens"] >= 1
        assert set(r["rewards"]) >= {"arithmetic"} and r["staleness"] == r["trainer_version"] - r["policy_version"]
        assert r["rollout_logprob"] <= 0 and r["accepted"] is True

    # the report shows them as a table
    from tests._synthetic_run import parse_page

    sections, _ = parse_page((run / "report" / "index.html").read_text())
    assert "48 rollouts of 6 (step, rank) samples" in sections["samples"].text
    assert rows[-1]["uid"] in sections["samples"].text

    state = json.loads((run / "trackers.json").read_text())
    second = _run(run, "train.steps=6", "guard.max_update_ratio=1e-9", "debug.report=false", resume=True)
    out = second.stdout + second.stderr
    assert second.returncode != 0, out[-4000:]
    assert "EVERY UPDATE WAS REJECTED: 2 of 2 updates of this run" in out, out[-4000:]
    assert "every one of the 2 updates of this run was rejected by the update guard" in out
    assert "lower train.lr (now 0.0005) or raise guard.max_update_ratio" in out
    assert "accepted=0, rejected=2" in out and "the update guard rejected the update (update_ratio=" in out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["verdict"] == "every update rejected" and summary["steps"]["resumed_from"] == 4
    assert summary["updates"]["this_launch"] == {"accepted": 0, "rejected": 2}
    assert summary["updates"]["accepted"] == 4 and summary["updates"]["rejected_by"]["update_ratio"]["count"] == 2

    # each rejected batch was dumped by the debugger, and its dump and anomaly line name its samples
    from asyncrl.debug.dump import read_dump

    anomalies = [json.loads(line) for line in (run / "debug" / "anomalies.jsonl").read_text().splitlines()]
    rejected = [a for a in anomalies if a["kind"] == "guard_rejection"]
    assert sorted((a["step"], a["rank"]) for a in rejected) == [(5, 0), (5, 1), (6, 0), (6, 1)]
    rows = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    for a in rejected:
        assert a["samples"] == {"file": "samples.jsonl", "step": a["step"], "rank": a["rank"]}
        _, body = read_dump(run / a["dump"])
        assert body["samples"] == a["samples"]
        batch = [r for r in rows if (r["step"], r["rank"]) == (a["step"], a["rank"])]
        assert len(batch) == 16 and all(r["why"] == "anomaly" and r["accepted"] is False for r in batch)
        assert sorted(r["uid"] for r in batch) == sorted(body["uids"])  # the whole bad batch, as text

    # every tracker continued the first launch's run
    assert json.loads((run / "trackers.json").read_text()) == state
    from tensorboard.backend.event_processing import plugin_event_accumulator as pea
    from tensorboard.util.tensor_util import make_ndarray

    acc = pea.EventAccumulator(str(run / "tensorboard"), size_guidance={pea.TENSORS: 0})
    acc.Reload()
    accepted = [(e.step, make_ndarray(e.tensor_proto).item()) for e in acc.Tensors("guard/accepted")]
    assert accepted == [(1, 1), (2, 1), (3, 1), (4, 1), (5, 0), (6, 0)]
    assert [e.step for e in acc.Tensors("samples/text_summary")] == [1, 2, 4, 6]
    assert [e.step for e in acc.Tensors("reward_mean")] == [1, 2, 3, 4, 5, 6]
    wandb_runs = sorted((run / "wandb").glob("offline-run-*"))
    assert len(wandb_runs) == 2
    launches = [_wandb_records(next(r.glob("run-*.wandb"))) for r in wandb_runs]
    heads = [next(x["run"] for x in recs if x["type"] == "run") for recs in launches]
    assert heads[0]["run_id"] == heads[1]["run_id"] == state["wandb"]["id"] and heads[1]["resume"] is True
    steps = [[x["history"]["item"]["train/global_step"] for x in recs
              if x["type"] == "history" and "reward_mean" in x["history"]["item"]] for recs in launches]
    assert steps == [[1, 2, 3, 4], [5, 6]]
    assert len(list((wandb_runs[0] / "files" / "media" / "table").glob("samples_*.table.json"))) == 3
    exits = [next(x["exit"] for x in recs if x["type"] == "exit") for recs in launches]
    assert exits[0].get("exit_code", 0) == 0 and exits[1]["exit_code"] == 1
    import mlflow

    mlflow.set_tracking_uri(state["mlflow"]["tracking_uri"])
    found = mlflow.search_runs(experiment_names=["asyncrl"], output_format="list")
    assert [r.info.run_id for r in found] == [state["mlflow"]["run_id"]]
    assert found[0].info.status == "FAILED" and found[0].data.tags["verdict"] == "every update rejected"
    history = mlflow.MlflowClient().get_metric_history(found[0].info.run_id, "guard/accepted")
    assert [(m.step, m.value) for m in history] == [(1, 1), (2, 1), (3, 1), (4, 1), (5, 0), (6, 0)]
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "mlruns").exists()  # nothing in the cwd

"""A recipe run that fails at start-up, under torchrun: it ends with the cause named (one line per failing rank, and
torchrun's summary naming the first failing rank with its exception), not with a secondary error (before: the report
writer's "metrics.jsonl is empty"), leaves nothing in /dev/shm, and ends its tracker's run as failed (MLflow, when
installed: its local store read back). The reward lives next to the run file, found from there by the trainer and by
the workers alike."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from asyncrl import hold_run_dir
from asyncrl.weights.start import shm_directory
from tests.integration.test_trackers import OFFLINE

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).parents[2]


def test_a_run_whose_workers_cannot_start_ends_naming_the_cause_and_cleans_up(tmp_path):
    (tmp_path / "judge.py").write_text(textwrap.dedent("""
        import os, sys
        if sys.argv[0].endswith(os.path.join("workers", "__main__.py")):  # a rollout worker process
            import gpu_only_dependency  # noqa: F401
        def score(completions, answer, **kwargs):
            return [float(c.strip() == a) for c, a in zip(completions, answer)]
    """))
    run_dir = tmp_path / "run"
    mlflow = importlib.util.find_spec("mlflow") is not None  # an optional extra: the tracker check only with it
    (tmp_path / "run.yaml").write_text(textwrap.dedent(f"""
        run_dir: {run_dir}
        report_to: [{"mlflow" if mlflow else ""}]
        data: {{num_prompts: 16}}
        train: {{steps: 2, sft_steps: 0}}
        debug: {{report: true}}
        rollout:
          group_size: 2
          batch_size: 2
          num_workers: 1
          max_failed_starts: 2
          restart_backoff_s: 0.05
          wait_timeout_s: 300
          worker:
            reward: {{funcs: ["judge:score"]}}   # judge.py beside this file, not on any path
            engine: {{type: hf, max_new_tokens: 4}}
    """))
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
            str(ROOT / "recipes" / "grpo.py"), "--config", str(tmp_path / "run.yaml")]
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env.update(OFFLINE, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=600)
    out = proc.stdout
    assert proc.returncode != 0, out[-3000:]
    assert "metrics.jsonl is empty" not in out and "During handling of the above exception" not in out, out[-3000:]
    cause = "WorkerStartError: rollout worker r0w-0 cannot start: it died 2 times in a row before its first group"
    assert f"[rank 0] grpo failed: {cause}" in out, out[-3000:]
    summary = out[out.index("Root Cause (first observed failure)"):]  # torchrun's, the run's last lines
    assert "rank      : 0" in summary and cause in summary and "No module named 'gpu_only_dependency'" in summary
    assert not shm_directory(run_dir).exists()  # the weight channel's shared memory is gone with the run
    hold_run_dir(run_dir).release()  # the run directory is free for the next run
    if mlflow:  # the failed run's tracker run is marked failed, not left running
        import mlflow as client

        state = json.loads((run_dir / "trackers.json").read_text())
        client.set_tracking_uri(state["mlflow"]["tracking_uri"])
        found = client.search_runs(experiment_names=["asyncrl"], output_format="list")
        assert [(r.info.run_id, r.info.status) for r in found] == [(state["mlflow"]["run_id"], "FAILED")]

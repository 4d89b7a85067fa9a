"""``asyncrl launch --engine slurm --dry-run``: the rendered sbatch script, against a golden copy (no Slurm here:
this is the whole of what is checked about Slurm; no Slurm cluster ran it).

Regenerate the golden file after an intended change with ``ASYNCRL_UPDATE_GOLDEN=1 pytest tests/unit/cluster``.
"""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

import pytest
import yaml

from asyncrl.cli import main
from asyncrl.cluster.slurm import prepare, render_sbatch
from asyncrl.config import RecipeConfig, load_config
from asyncrl.transport.zmq import read_curve_keys_file

GOLDEN = Path(__file__).parent / "golden"
RUN_FILE = GOLDEN / "two_trainer_nodes.yaml"
RUN_FILE_ARG = "tests/unit/cluster/golden/two_trainer_nodes.yaml"  # as the hosts would see it, relative


def _render(overrides: list[str]) -> str:
    cfg = load_config(str(RUN_FILE), overrides)
    return render_sbatch(cfg, run_file=RUN_FILE_ARG, overrides=overrides, recipe="recipes/grpo.py",
                         python="python")


def test_sbatch_script_matches_golden():
    script = _render(["train.steps=500"])
    golden = GOLDEN / "two_trainer_nodes.sbatch"
    if os.environ.get("ASYNCRL_UPDATE_GOLDEN"):
        golden.write_text(script)
    assert script == golden.read_text(), "the rendered script changed: ASYNCRL_UPDATE_GOLDEN=1 to accept"


def test_sbatch_script_structure():
    script = _render([])
    assert "#SBATCH --nodes=4" in script  # 2 trainer + 2 rollout
    assert "#SBATCH --gpus-per-node=8" in script and "#SBATCH --exclusive" in script
    assert "--nnodes=2 --nproc-per-node=8" in script and '--rdzv-endpoint="$RDZV_HOST:29500"' in script
    assert "--ntasks-per-node=4" in script and 'asyncrl.cli worker --registry "$RUN_DIR"' in script
    assert script.index("asyncrl.cluster.slurm") < script.index("torch.distributed.run")  # keys before anything


def test_launch_dry_run_prints_the_script(monkeypatch):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as e:
        main(["launch", "--config", str(RUN_FILE), "--engine", "slurm", "--dry-run", "--recipe", "recipes/grpo.py"])
    assert e.value.code == 0
    assert out.getvalue().startswith("#!/bin/bash") and "#SBATCH --job-name=qwen-math" in out.getvalue()


def test_launch_local_dry_run_is_torchrun():
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main(["launch", "--config", "recipes/configs/tiny_cpu.yaml", "--dry-run", "--recipe", "recipes/grpo.py",
              "cluster.trainer.ranks_per_node=2", "train.steps=3"])
    assert out.getvalue().strip().endswith("--standalone --nproc-per-node=2 recipes/grpo.py --config "
                                           "recipes/configs/tiny_cpu.yaml cluster.trainer.ranks_per_node=2 "
                                           "train.steps=3")


def test_prepare_writes_keys_allow_list_and_a_valid_run_file(tmp_path):
    run_file = prepare(str(tmp_path / "run"), str(RUN_FILE), 3, ["train.steps=7"])
    cluster = tmp_path / "run" / "cluster"
    assert oct(run_file.stat().st_mode & 0o777) == "0o600" and oct((cluster / "pool.key").stat().st_mode & 0o777) == "0o600"
    allowed = read_curve_keys_file(str(cluster / "allowed_keys"))
    assert len(allowed) == 3 and len(set(allowed)) == 3
    tree = yaml.safe_load(run_file.read_text())
    cfg = load_config(str(run_file), [])
    assert isinstance(cfg, RecipeConfig) and cfg.train.steps == 7 and cfg.rollout.num_workers == 0
    assert cfg.rollout.transport.curve_allowed_keys_file == str(cluster / "allowed_keys")
    assert cfg.weights.type == "zmq" and tree["cluster"]["engine"] == "slurm"
    again = prepare(str(tmp_path / "run"), str(RUN_FILE), 3, [])  # a requeued job keeps its keys
    assert read_curve_keys_file(str(cluster / "allowed_keys")) == allowed and again == run_file

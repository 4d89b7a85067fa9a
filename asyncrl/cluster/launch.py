"""``asyncrl launch --config RUN.yaml [--engine local|ray|slurm] [--dry-run] [KEY=VALUE ...]``: one entry point.

- ``local`` (the default, ``cluster.engine``): ``torchrun --standalone --nproc-per-node R recipes/grpo.py ...`` on
  this machine, exactly today's path (``make run`` is unchanged);
- ``ray``: the Ray engine (:mod:`asyncrl.integrations.ray`) joins ``cluster.address``, places the trainer gang and the
  rollout fleet, and supervises both until the trainer ends;
- ``slurm``: the ``sbatch`` script (:mod:`asyncrl.cluster.slurm`); ``--dry-run`` prints it, otherwise it is written
  to ``RUN_DIR/cluster/job.sbatch`` and submitted with ``sbatch``.

``--dry-run`` prints what would run (the command, the script, or the Ray plan) and starts nothing. The command line
is ``asyncrl.cli``'s; this module holds the ``local`` and ``slurm`` paths (the ``ray`` one imports Ray, so it lives
in the application layer, :mod:`asyncrl.integrations.ray`).
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from asyncrl.config import RecipeConfig

__all__ = ["default_recipe", "local_command", "run_local", "run_slurm"]


def default_recipe() -> str:
    """``recipes/grpo.py`` of this checkout (the recipes are scripts beside the package, not in the wheel), else the
    one in the working directory."""
    beside = Path(__file__).resolve().parents[2] / "recipes" / "grpo.py"
    return str(beside) if beside.exists() else "recipes/grpo.py"


def local_command(run_file: str | None, overrides: list[str], *, ranks: int, recipe: str) -> list[str]:
    """The ``torchrun`` command of a local run (``python -m torch.distributed.run`` where no ``torchrun`` is on
    ``PATH``: a virtual environment not activated)."""
    torchrun = ["torchrun"] if shutil.which("torchrun") else [sys.executable, "-m", "torch.distributed.run"]
    return [*torchrun, "--standalone", f"--nproc-per-node={ranks}", recipe,
            *(["--config", run_file] if run_file else []), *overrides]


def run_local(cfg: RecipeConfig, run_file: str | None, overrides: list[str], *, recipe: str, resume: bool,
              dry_run: bool) -> int:
    """``engine: local``: ``torchrun`` on this machine (prints it with ``dry_run``); returns its exit status."""
    cmd = local_command(run_file, overrides, ranks=cfg.cluster.trainer.ranks_per_node, recipe=recipe)
    if resume:
        cmd.insert(cmd.index(recipe) + 1, "--resume")
    if dry_run:
        print(shlex.join(cmd))
        return 0
    return subprocess.call(cmd)


def run_slurm(cfg: RecipeConfig, run_file: str | None, overrides: list[str], *, recipe: str, python: str,
              dry_run: bool) -> int:
    """``engine: slurm``: prints the ``sbatch`` script (``dry_run``), or writes it to ``RUN_DIR/cluster/job.sbatch``
    and submits it; returns ``sbatch``'s exit status."""
    from asyncrl.cluster.slurm import render_sbatch

    if run_file is None:
        raise SystemExit("asyncrl launch --engine slurm needs --config: the hosts read the run file")
    script = render_sbatch(cfg, run_file=run_file, overrides=overrides, recipe=recipe, python=python)
    if dry_run:
        sys.stdout.write(script)
        return 0
    if shutil.which("sbatch") is None:
        raise SystemExit("sbatch not found: run this on a Slurm login node, or use --dry-run to print the script")
    path = Path(cfg.run_dir) / "cluster" / "job.sbatch"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(script)
    return subprocess.call(["sbatch", str(path)])

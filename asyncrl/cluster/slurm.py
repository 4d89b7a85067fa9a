"""``asyncrl launch --engine slurm``: the ``sbatch`` script of a run, rendered from its run file (no Slurm here).

The allocation's first ``cluster.trainer.nnodes`` hosts run the trainer (``srun torchrun --rdzv-endpoint`` on the
first of them, torchtitan's and prime-rl's pattern); the next ``cluster.slurm.rollout_nodes`` hosts run
``cluster.fleet.workers_per_node`` rollout workers each (``asyncrl worker --registry RUN_DIR``). Nothing is typed
by hand: before anything starts, :func:`prepare` (run by the script's first step, on shared storage) writes

    RUN_DIR/cluster/run.yaml         the run file with the cluster overrides and the pools' CURVE key pair (0600)
    RUN_DIR/cluster/allowed_keys     the workers' public keys: the pools' allow-list (watched, so it can change)
    RUN_DIR/cluster/keys/worker-N    worker N's secret key (0600), one per worker task

and each trainer rank writes its pool's record under ``RUN_DIR/cluster/pools/`` (:mod:`asyncrl.cluster.registry`)
once bound; workers wait for a complete set, then connect with CURVE. The run directory must be on storage every
host of the allocation shares.
"""

from __future__ import annotations

import argparse
import os
import shlex
from pathlib import Path

import yaml

from asyncrl.config import RecipeConfig, apply_overrides, from_dict
from asyncrl.config.cluster import ClusterConfig

__all__ = ["prepare", "render_sbatch"]


def _q(value: str) -> str:
    return shlex.quote(str(value))


def render_sbatch(cfg: RecipeConfig, *, run_file: str, overrides: list[str], recipe: str = "recipes/grpo.py",
                  python: str = "python") -> str:
    """The ``sbatch`` script of a run (``cfg`` is the run file plus ``overrides``, as the recipe will read them).

    Args:
        cfg: the resolved run config (its ``cluster`` section: trainer nodes and ranks, the fleet, ``slurm``).
        run_file: the run file's path as the hosts see it (shared storage).
        overrides: the dotted overrides given to ``asyncrl launch``; passed on unchanged.
        recipe: the recipe script's path as the hosts see it.
        python: the interpreter on the hosts (a venv's, after ``cluster.slurm.setup``).
    """
    cluster: ClusterConfig = cfg.cluster
    trainer, fleet, slurm = cluster.trainer, cluster.fleet, cluster.slurm
    nodes = trainer.nnodes + slurm.rollout_nodes
    workers = slurm.rollout_nodes * fleet.workers_per_node
    header = [f"#SBATCH --job-name={slurm.job_name}", f"#SBATCH --nodes={nodes}", "#SBATCH --ntasks-per-node=1",
              f"#SBATCH --time={slurm.time}", "#SBATCH --output=%x-%j.out"]
    if slurm.gpus_per_node:
        header.append(f"#SBATCH --gpus-per-node={slurm.gpus_per_node}")
    if slurm.partition:
        header.append(f"#SBATCH --partition={slurm.partition}")
    if slurm.account:
        header.append(f"#SBATCH --account={slurm.account}")
    header += [f"#SBATCH {line}" for line in slurm.extra_sbatch]
    run_dir = cfg.run_dir
    prepare_args = " ".join(_q(a) for a in [
        "--run-dir", run_dir, "--run-file", run_file, "--workers", str(workers), *overrides])
    lines = [
        "#!/bin/bash",
        f"# asyncrl launch --engine slurm: {run_file} {' '.join(overrides)}".rstrip(),
        "# trainer: srun torchrun on the first hosts; rollout workers: asyncrl worker --registry on the others.",
        *header,
        "",
        "set -euo pipefail",
        *slurm.setup,
        f"export RUN_DIR={_q(run_dir)}  # the worker tasks' bash -c reads it",
        'mapfile -t HOSTS < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        f'TRAINER_HOSTS=$(IFS=,; echo "${{HOSTS[*]:0:{trainer.nnodes}}}")',
        f'ROLLOUT_HOSTS=$(IFS=,; echo "${{HOSTS[*]:{trainer.nnodes}}}")',
        'RDZV_HOST="${HOSTS[0]}"',
        "",
        "# keys and the merged run file, on shared storage (the pools' secret key never leaves RUN_DIR/cluster)",
        f"{python} -m asyncrl.cluster.slurm {prepare_args}",
        "",
        "# the trainer: every rank binds its pool on its host's address and writes its record under "
        "RUN_DIR/cluster/pools",
        f"srun --nodes={trainer.nnodes} --ntasks-per-node=1 --nodelist=\"$TRAINER_HOSTS\" \\",
        f"    {python} -m torch.distributed.run --nnodes={trainer.nnodes} "
        f"--nproc-per-node={trainer.ranks_per_node} \\",
        f"    --rdzv-backend=c10d --rdzv-endpoint=\"$RDZV_HOST:{slurm.rdzv_port}\" --rdzv-id=\"$SLURM_JOB_ID\" \\",
        f"    {_q(recipe)} --config \"$RUN_DIR/cluster/run.yaml\" --resume &",
        "TRAINER=$!",
        "",
    ]
    if workers:
        lines += [
            "# the rollout workers: each resolves every rank's endpoint and the pools' public key from the records",
            f"srun --nodes={slurm.rollout_nodes} --ntasks-per-node={fleet.workers_per_node} "
            "--nodelist=\"$ROLLOUT_HOSTS\" \\",
            "    bash -c 'exec " + python + " -m asyncrl.cli worker --registry \"$RUN_DIR\" "
            "--client-key-file \"$RUN_DIR/cluster/keys/worker-$SLURM_PROCID\" "
            "--worker-id \"$(hostname)-$SLURM_PROCID\"' &",
            "WORKERS=$!",
            "",
        ]
    lines += [
        "# the run ends with its trainer; the pools say SHUTDOWN and the workers exit 0",
        "STATUS=0; wait $TRAINER || STATUS=$?",
    ]
    if workers:
        lines += ["wait $WORKERS || true"]
    lines += ["exit $STATUS", ""]
    return "\n".join(lines)


def prepare(run_dir: str, run_file: str, workers: int, overrides: list[str]) -> Path:
    """Writes the keys and the merged run file of a Slurm run under ``run_dir/cluster`` (see the module docstring);
    returns the merged run file. Existing keys are kept (a requeued job keeps its workers' identities)."""
    from asyncrl.cluster.registry import write_allow_list
    from asyncrl.transport.zmq import generate_curve_keys, read_curve_keys_file, write_curve_key_file

    cluster = Path(run_dir) / "cluster"
    (cluster / "keys").mkdir(parents=True, exist_ok=True)
    publics = []
    for n in range(workers):
        path = cluster / "keys" / f"worker-{n}"
        if path.exists():
            secret = read_curve_keys_file(str(path))[0]
            import zmq

            publics.append(zmq.curve_public(secret.encode()).decode())
        else:
            publics.append(write_curve_key_file(str(path)))
    write_allow_list(cluster / "allowed_keys", publics)
    pool_key = cluster / "pool.key"
    if pool_key.exists():
        public, secret = read_curve_keys_file(str(pool_key))[:2]
    else:
        public, secret = generate_curve_keys()
        fd = os.open(pool_key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"# the pools' CURVE key pair: public, then secret\n{public}\n{secret}\n")
    tree = yaml.safe_load(Path(run_file).read_text()) or {}
    apply_overrides(tree, [*overrides, "cluster.engine=slurm", "rollout.num_workers=0",
                           "rollout.transport.bind=tcp://0.0.0.0:0", "weights.type=zmq",
                           "weights.bind=tcp://0.0.0.0:0", "weights.delta=true"])
    # set, not overridden: Z85 keys hold characters YAML would read as syntax
    tree["rollout"].setdefault("transport", {}).update(curve_public_key=public, curve_secret_key=secret,
                                                       curve_allowed_keys_file=str(cluster / "allowed_keys"))
    from_dict(RecipeConfig, tree)  # refused here, before sbatch, if the result is not a valid run
    out = cluster / "run.yaml"
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(tree, f, sort_keys=False)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m asyncrl.cluster.slurm", description=prepare.__doc__)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--run-file", required=True)
    p.add_argument("--workers", type=int, required=True)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    print(prepare(args.run_dir, args.run_file, args.workers, args.overrides))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

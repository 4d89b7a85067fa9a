"""Launching trainer ranks for a check stage: ``nproc`` real processes with torchrun's environment (private).

    check process:  TCPStore(port 0, is_master)   ── hosts the rendezvous, as torchrun's agent does
                    Popen × nproc  ─────────────────► rank r: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT,
                                                      TORCHELASTIC_USE_AGENT_STORE=True
                                                      dist.init_process_group("gloo")   (env://: a store client)
                    wait (deadline) ◄──────────────── every rank's exit status, stdout and stderr

The store binds port 0 and lives in the launching process, like the ``torchrun`` agent's, so there is no
port race and the ranks run unchanged under a real ``torchrun`` (``init_process_group`` with the default
``env://``). Who blocks on what: the launcher waits on the processes with one deadline; when a rank fails
the others would hang in a collective, so the remaining ranks are ended (by pid) as soon as one exits
non-zero. Shared by every stage that needs ranks (``parallel``, ``checkpoint``, ``logprobs``).
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["RankResult", "launch_ranks", "torchrun_env_names"]

_REPO = Path(__file__).resolve().parents[2]
_POLL_S = 0.05

torchrun_env_names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                      "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE")
"""The variables torchrun sets for a rank; a child that must not join the ranks' group (an engine) drops them."""


@dataclass(kw_only=True, slots=True)
class RankResult:
    """One rank's process, finished."""

    rank: int
    returncode: int
    """The exit status; -9 when the launcher ended it (another rank failed, or the deadline passed)."""
    stdout: str
    stderr: str

    def tail(self, chars: int = 2000) -> str:
        """The end of its output, for an error message."""
        return (self.stdout[-chars // 2 :] + "\n" + self.stderr[-chars:]).strip()


def launch_ranks(argv: list[str], nproc: int, *, timeout_s: float = 600.0, env: dict[str, str] | None = None,
                 cwd: str | Path | None = None) -> list[RankResult]:
    """Runs ``python ARGV`` as ``nproc`` gloo ranks (``argv`` e.g. ``["-m", "asyncrl.check._logprob_rank", ...]``).

    Args:
        argv: the interpreter's arguments (a module with ``-m`` or a script path, then its arguments).
        nproc: the world size (>= 1; 1 still runs one rank process with the environment set).
        timeout_s: the deadline for all ranks together.
        env: extra environment variables for every rank.
        cwd: the ranks' working directory (default: the repository root, so ``tests.*`` modules import too).

    Returns:
        one :class:`RankResult` per rank, in rank order; a non-zero ``returncode`` means that rank failed
        (the caller turns it into a failed stage with :meth:`RankResult.tail`).

    Raises:
        ValueError: ``nproc < 1``.
    """
    import torch.distributed as dist

    if nproc < 1:
        raise ValueError(f"{nproc=} must be >= 1")
    store = dist.TCPStore("127.0.0.1", 0, world_size=nproc + 1, is_master=True,
                          timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
    base = {k: v for k, v in os.environ.items() if k not in torchrun_env_names and not k.startswith("TORCHELASTIC_")}
    path = [str(_REPO), *filter(None, base.get("PYTHONPATH", "").split(os.pathsep))]
    base.update(env or {}, PYTHONPATH=os.pathsep.join(path), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port),
                WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", GROUP_WORLD_SIZE="1",
                ROLE_WORLD_SIZE=str(nproc), TORCHELASTIC_USE_AGENT_STORE="True", OMP_NUM_THREADS="1")
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    procs, files = [], []
    for rank in range(nproc):
        out = open(logs / f"asyncrl-check-rank-{os.getpid()}-{store.port}-{rank}.out", "w+")  # noqa: SIM115
        err = open(logs / f"asyncrl-check-rank-{os.getpid()}-{store.port}-{rank}.err", "w+")  # noqa: SIM115
        files.append((out, err))
        rank_env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "ROLE_RANK": str(rank)}
        procs.append(subprocess.Popen([sys.executable, *argv], env=rank_env, stdout=out, stderr=err,
                                      cwd=str(cwd or _REPO)))
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            codes = [p.poll() for p in procs]  # every process each round: any() would stop at the first live one
            if all(c is not None for c in codes):
                break
            if any(c not in (None, 0) for c in codes) or time.monotonic() > deadline:
                for p in procs:  # the others would wait in a collective for the dead rank until their timeout
                    if p.poll() is None:
                        p.kill()
            time.sleep(_POLL_S)  # polling process exits: no condition to wait on across several children
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        del store
    results = []
    for rank, (p, (out, err)) in enumerate(zip(procs, files)):
        out.seek(0)
        err.seek(0)
        results.append(RankResult(rank=rank, returncode=p.returncode, stdout=out.read(), stderr=err.read()))
        for f in (out, err):
            f.close()
            os.unlink(f.name)
    return results

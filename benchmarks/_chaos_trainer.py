"""The chaos suite's trainer: one incarnation of a run that ``benchmarks/chaos.py`` kills and resumes.

::

    resolve checkpoint ─► truncate consumed.jsonl ─► new incarnation ─► RolloutLoader (local workers, pool on --port)
    until --epochs epochs are trained:
         for batch in loader:   record it ─► set_policy_version(v+1) ─► publish weights (shm, incarnation)
                                every --every steps: CheckpointDir save (stage, write, commit; pausable)
         at the epoch's end:    a save (unless its last step saved already): the end-of-epoch state

A real trainer loop without the model: the "update" is ``version += 1``. What it writes into ``--run-dir``
(the harness reads all of it; nothing here checks the guarantees):

* ``consumed.jsonl``: one line per committed step ``{step, version, incarnation, group_ids, pairs, ...}``,
  ``version`` the policy version the batch was trained at, ``pairs`` the ``[incarnation, policy_version]``
  of its rollouts; truncated with :func:`asyncrl.checkpoint.run_dir.truncate_records` to the resumed step on resume,
  so after the run it is the history of the final timeline.
* ``history.jsonl``: the same lines, never truncated (every batch any incarnation trained).
* ``lineage.jsonl``: one line per incarnation ``{incarnation, parent, start_version, start_step, pid}``.
* ``pids/{incarnation}.json``: this trainer's pid and every local worker pid it started (rewritten on change).
* ``stats/{incarnation}.json``: ``loader.stats()`` every few steps; ``done.json`` at the end.
* ``checkpoints/``: an :class:`asyncrl.checkpoint.CheckpointDir` (``loader-rank0.pt`` = loader state,
  ``trainer-rank0.pt`` = step, version, incarnation).

Fault injection: if ``pause-request`` in the run directory names a save point (one of
:data:`asyncrl.checkpoint.SAVE_POINTS` or ``written``: files written, not committed), optionally as
``point@step`` (only the save of that step), the next save that reaches it writes ``paused.json``
``{point, step, pid}`` and sleeps until the harness SIGKILLs it (at most ``PAUSE_S``, then it carries on and
says so on stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from asyncrl import FakeEngineConfig, LoaderConfig, RolloutLoader, TransportConfig, WorkerConfig
from asyncrl.checkpoint.checkpointer import CheckpointDir
from asyncrl.checkpoint.run_dir import RunDirLock, truncate_records
from asyncrl.config import GateConfig, WeightSyncConfig
from asyncrl.pool.timeline import new_incarnation
from asyncrl.rollout import Group
from asyncrl.weights import setup_weight_broadcaster
from datapipes.collate import collate_groups

PAUSE_S = 60.0
GROUP_SIZE = 4
BATCH_SIZE = 8
MAX_STALENESS = 1
MAX_MESSAGE_BYTES = 1 << 20
VOCAB_SIZE = 32000
WORKER_PREFIX = "r0w"
"""Local workers are named ``r0w-0``, ``r0w-1``, ... (the rogue's HELLO storm reuses ``r0w-0``)."""


def prompts(n: int) -> list[dict[str, Any]]:
    return [{"prompt_ids": [i % 250 + 1, 7, 9]} for i in range(n)]


def worker_config(weights_dir: str) -> WorkerConfig:
    """Local and remote workers alike: fake engine, shm weights of the run."""
    return WorkerConfig(slots=4, max_batch=2, engine=FakeEngineConfig(max_new_tokens=16, seconds_per_token=0.001),
                        weights=WeightSyncConfig(type="shm", address=weights_dir, wait_for_first_s=60))


def transport_config(port: int) -> TransportConfig:
    return TransportConfig(bind=f"tcp://127.0.0.1:{port}", heartbeat_s=0.2, peer_timeout_s=3.0,
                           handshake_timeout_s=60, max_message_bytes=MAX_MESSAGE_BYTES)


def loader_config(args: argparse.Namespace) -> LoaderConfig:
    return LoaderConfig(
        group_size=GROUP_SIZE, batch_size=BATCH_SIZE, capacity=32, max_staleness=MAX_STALENESS,
        num_workers=args.workers, lease_timeout_s=20, wait_timeout_s=args.wait_timeout_s, poll_timeout_s=0.2,
        restart_workers=True, restart_backoff_s=0.2, restart_backoff_max_s=2.0,
        transport=transport_config(args.port), gate=GateConfig(vocab_size=VOCAB_SIZE),
        worker=worker_config(str(Path(args.run_dir) / "weights")),
    )


def collate(groups: list[Group]) -> dict[str, Any]:
    batch = collate_groups(groups)
    batch["incarnations"] = [r.incarnation for g in groups for r in g.rollouts]
    return batch


def write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def append_line(path: Path, obj: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(obj) + "\n")


class Pauser:
    """The CheckpointDir hook: pauses a save at the point ``pause-request`` names (see the module docstring)."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir

    def __call__(self, point: str, step: int) -> None:
        try:
            wanted = (self.run_dir / "pause-request").read_text().strip()
        except FileNotFoundError:
            return
        wanted, _, at = wanted.partition("@")
        if wanted != point or (at and int(at) != step):
            return
        write_json(self.run_dir / "paused.json", {"point": point, "step": step, "pid": os.getpid()})
        time.sleep(PAUSE_S)  # the harness SIGKILLs us here
        print(f"chaos trainer: paused at {point} of step {step} for {PAUSE_S} s and nobody killed it", file=sys.stderr)


def record(batch: dict[str, Any], step: int, version: int, incarnation: str) -> dict[str, Any]:
    """One consumed-log line: what the batch held, reduced to what the harness checks."""
    versions = batch["policy_versions"].tolist()
    mask = batch["loss_mask"]
    return {
        "step": step,
        "version": version,
        "incarnation": incarnation,
        "group_ids": list(batch["group_ids"]),
        "pairs": sorted({(inc, v) for inc, v in zip(batch["incarnations"], versions)}),
        "group_workers": [sorted(set(batch["worker_ids"][g * GROUP_SIZE:(g + 1) * GROUP_SIZE]))
                          for g in range(len(batch["group_ids"]))],
        "max_abs_reward": float(batch["rewards"].abs().max()),
        "token_range": [int(batch["input_ids"].min()), int(batch["input_ids"].max())],
        "min_logprob": float(batch["rollout_logprobs"][mask].min()) if bool(mask.any()) else 0.0,
    }


def watch_pids(loader: RolloutLoader, path: Path, stop: threading.Event) -> None:
    """Rewrites ``path`` whenever the launcher starts a worker, so the harness knows every pid we started."""
    seen: list[int] = []
    while not stop.is_set():
        new = [p for p in loader.launcher.pids if p is not None and p not in seen] if loader.launcher else []
        if new:
            seen += new
            write_json(path, {"trainer": os.getpid(), "workers": seen, "live": loader.launcher.pids})
        stop.wait(0.05)


def save(ckdir: CheckpointDir, loader: RolloutLoader, step: int, version: int, incarnation: str) -> None:
    tmp = ckdir.stage(step)
    torch.save(loader.state_dict(), tmp / "loader-rank0.pt")
    torch.save({"step": step, "version": version, "incarnation": incarnation}, tmp / "trainer-rank0.pt")
    (tmp / ".metadata").write_text(json.dumps({"step": step}))
    ckdir.hook("written", step)
    ckdir.commit(tmp, step)


def main(args: argparse.Namespace) -> None:
    run = Path(args.run_dir)
    lock = RunDirLock(run)
    lock.acquire()  # a trainer whose predecessor still runs is refused here (the harness counts it)
    for sub in ("pids", "stats"):
        (run / sub).mkdir(exist_ok=True)
    ckdir = CheckpointDir(run / "checkpoints", world_size=1, keep=2, hook=Pauser(run))
    path, note = ckdir.resolve() if args.resume else (None, "")
    if note:
        print(f"chaos trainer: {note}", file=sys.stderr)
    trainer = torch.load(path / "trainer-rank0.pt", weights_only=True) if path else {}
    step, version = trainer.get("step", 0), trainer.get("version", 0)
    truncate_records(run / "consumed.jsonl", step)
    incarnation = new_incarnation()
    append_line(run / "lineage.jsonl", {"incarnation": incarnation, "parent": trainer.get("incarnation"),
                                        "start_version": version, "start_step": step, "pid": os.getpid(),
                                        "checkpoint": path.name if path else None, "note": note})
    weights_dir = run / "weights"
    shutil.rmtree(weights_dir, ignore_errors=True)  # a resume replaces the run's weights directory
    weights_dir.mkdir()
    broadcaster = setup_weight_broadcaster("shm", directory=str(weights_dir))
    loader = RolloutLoader(prompts(args.prompts), loader_config(args), incarnation=incarnation, collate_fn=collate)
    stop = threading.Event()
    threading.Thread(target=watch_pids, args=(loader, run / "pids" / f"{incarnation}.json", stop), daemon=True).start()
    if path:
        loader.load_state_dict(torch.load(path / "loader-rank0.pt", weights_only=True))
    loader.set_policy_version(version)
    broadcaster.publish({"w": torch.full((4,), float(version))}, version, incarnation=incarnation)
    total = args.epochs * -(-args.prompts // BATCH_SIZE)
    while step < total:
        for batch in loader:
            step += 1
            line = record(batch, step, version, incarnation)
            append_line(run / "history.jsonl", line)
            append_line(run / "consumed.jsonl", line)  # before the checkpoint that counts it
            version += 1  # the "optimizer step"
            loader.set_policy_version(version)  # commits the batch
            broadcaster.publish({"w": torch.full((4,), float(version))}, version, incarnation=incarnation)
            if step % args.every == 0:
                save(ckdir, loader, step, version, incarnation)
            if step % 5 == 0:
                write_json(run / "stats" / f"{incarnation}.json", {"step": step, **loader.stats()})
            if args.step_sleep_s:
                time.sleep(args.step_sleep_s)
        if step % args.every and step < total:  # the epoch ended between checkpoints: save its end-of-epoch state
            save(ckdir, loader, step, version, incarnation)
    stats = {"step": step, **loader.stats()}
    write_json(run / "stats" / f"{incarnation}.json", stats)
    loader.close()
    stop.set()
    broadcaster.close()
    write_json(run / "done.json", {"step": step, "version": version, "incarnation": incarnation, "stats": stats})
    lock.release()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--port", type=int, required=True, help="the pool's fixed loopback port (remote workers reconnect)")
    p.add_argument("--prompts", type=int, default=2000)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--workers", type=int, default=2, help="local workers")
    p.add_argument("--every", type=int, default=3, help="checkpoint every this many steps")
    p.add_argument("--resume", action="store_true", help="resume from the newest complete checkpoint")
    p.add_argument("--wait-timeout-s", type=float, default=120.0)
    p.add_argument("--step-sleep-s", type=float, default=0.0, help="simulated training time per step")
    return p.parse_args(argv)


if __name__ == "__main__":
    main(parse())

"""The chaos suite: a run under random SIGKILLs and a rogue peer, then exactly-once accounting from its logs.

::

    harness ──starts──► trainer (benchmarks/_chaos_trainer.py) ──its launcher──► local workers
       │                pool on a fixed loopback port ◄══ZeroMQ══ remote workers (asyncrl worker)
       │                                              ◄══════════ rogue peer (benchmarks/_chaos_rogue.py)
       └─ every tick (0.1 s): SIGKILL a local worker, replace a remote worker, SIGKILL the trainer (at a
          random moment, paused inside a checkpoint save, or right after an epoch end's checkpoint and again after
          the resumed trainer's next one) and start it again with --resume, all by pid, when the run's
          progress crosses the next planned step; a phase without progress for --phase-deadline-s is a hang
          (reported, the trainer killed and resumed), the whole run is bounded by --run-deadline-s.

After the run (``account``): from ``consumed.jsonl`` (the final timeline's steps) every prompt's group
consumed exactly once; from ``history.jsonl`` (every batch any incarnation trained) no rollout newer than the
trainer, staler than ``max_staleness``, from a dead timeline (checked against ``lineage.jsonl``, not the
pool's own timeline), from the rogue (``worker_id`` ``forged-*``) or out of the gate's ranges; every pid the
harness or a trainer started is gone. The pool's counters are reported alongside.

    .venv/bin/python -m benchmarks.chaos --prompts 1000 --epochs 3 --epoch-end-resumes 2 --worker-kills 50 \\
        --trainer-kills 5 --save-kills 20 --hostile 100000 --rate 500 --out benchmarks/results/chaos-DATE.json

``tests/chaos/test_chaos.py`` runs a short version in CI. The torchrun-killed scenario (a launcher's ranks
and their workers die with it, the run directory's lock and records) is ``tests/integration/test_recipe.py``'s.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime as dt
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import _chaos_trainer as T
from benchmarks._report import git_commit, machine

__all__ = ["ChaosConfig", "account", "main", "run_chaos"]

SAVE_KILL_POINTS = ("staged", "written", "marked", "renamed", "pointed", "pruned")
"""Where kills inside a save land, in rotation (CheckpointDir's save points plus ``written``)."""
REPO = Path(__file__).resolve().parent.parent
REMOTE_PEER_TIMEOUT_S = 30.0
"""Remote workers wait this long for a silent pool: they outlive trainer restarts, holding the dead
incarnation's newest weights when the resumed trainer comes up (the dead-timeline case)."""


@dataclass(kw_only=True, slots=True)
class ChaosConfig:
    """One chaos run."""

    prompts: int = 2000
    """Prompts in an epoch; the run trains ``epochs * ceil(prompts / 8)`` steps on its final timeline."""
    epochs: int = 1
    """Epochs trained (every group of every epoch exactly once)."""
    epoch_end_resumes: int = 0
    """Chains of two resumes through an epoch end: the trainer is SIGKILLed right after the checkpoint of an
    epoch's end, resumed, SIGKILLed again right after its next checkpoint, and resumed again (at most
    ``epochs - 1``: the last epoch's end is the run's)."""
    workers: int = 2
    """Local workers the trainer starts (restarted by its launcher when killed)."""
    remote_workers: int = 1
    """Remote workers (``asyncrl worker --connect``) kept running; one is replaced at every remote kill."""
    worker_kills: int = 50
    """Local worker SIGKILLs, spread over the run."""
    remote_kills: int = 10
    """Remote worker SIGKILLs (each followed by a new remote worker joining)."""
    trainer_kills: int = 5
    """Trainer SIGKILLs at a random moment of a step, each followed by ``--resume``."""
    save_kills: int = 20
    """Trainer SIGKILLs inside a checkpoint save (rotating over :data:`SAVE_KILL_POINTS`), each resumed."""
    hostile: int = 100_000
    """Hostile messages the rogue sends at most (0: no rogue)."""
    rate: float = 500.0
    """Hostile messages per second, at most."""
    storm_s: float = 0.05
    """Period of the rogue's HELLO storm reusing the id of local worker ``r0w-0`` (0: off)."""
    every: int = 3
    """Checkpoint every this many steps."""
    seed: int = 0
    phase_deadline_s: float = 120.0
    """A trainer making no progress for this long (or a save pause not reached) is a hang."""
    run_deadline_s: float = 3600.0
    """The whole run's deadline (a hang too)."""
    orphan_deadline_s: float = 20.0
    """A local worker still alive this long after its trainer was killed is an orphan."""
    step_sleep_s: float = 0.0
    """Simulated training time per step in the trainer."""

    def __post_init__(self):
        steps = self.epochs * math.ceil(self.prompts / T.BATCH_SIZE)
        if not 0 <= self.epoch_end_resumes < max(self.epochs, 1):
            raise ValueError(f"{self.epoch_end_resumes=} must be in [0, {self.epochs=} - 1]: the last epoch's end "
                             "is the run's")
        kills = self.trainer_kills + self.save_kills
        if kills and steps < (kills + 1) * (self.every + 2):
            raise ValueError(f"{self.prompts=} gives {steps} steps, too few for {kills} trainer kills with "
                             f"checkpoints every {self.every} steps (need >= {(kills + 1) * (self.every + 2)})")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def alive(pid: int) -> bool:
    """True if ``pid`` runs and is one of ours (a worker, trainer or rogue: guards against pid reuse)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                return False
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return b"workers" in cmdline or b"asyncrl" in cmdline or b"_chaos_" in cmdline


def read_lines(path: Path) -> list[dict[str, Any]]:
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:  # a line torn by a kill
                pass
    return rows


def last_step(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4096))
            lines = f.read().splitlines()
    except FileNotFoundError:
        return 0
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError):
            continue
    return 0


class Harness:
    """Runs one chaos run in ``run_dir``; every process it (or a trainer) starts is tracked by pid."""

    def __init__(self, cfg: ChaosConfig, run_dir: Path, log=print):
        self.cfg, self.run, self.log = cfg, run_dir, log
        self.rng = random.Random(cfg.seed)
        self.port = free_port()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.epoch_steps = math.ceil(cfg.prompts / T.BATCH_SIZE)
        self.total_steps = cfg.epochs * self.epoch_steps
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.trainer: subprocess.Popen | None = None
        self.trainers: list[subprocess.Popen] = []
        self.remotes: list[subprocess.Popen] = []  # the remote workers running (as far as we know)
        self.all_remotes: list[subprocess.Popen] = []
        self.rogue: subprocess.Popen | None = None
        self.events: list[dict[str, Any]] = []
        self.counts: collections.Counter[str] = collections.Counter()
        self.hangs: list[dict[str, Any]] = []
        self.orphans: list[tuple[int, float]] = []  # (pid, deadline) of local workers of a killed trainer
        self.orphan_outlived: list[int] = []
        self.orphan_max_s = 0.0
        self.crashes: list[dict[str, Any]] = []
        self.t0 = time.monotonic()
        kills = ["trainer"] * cfg.trainer_kills + ["save"] * cfg.save_kills
        self.rng.shuffle(kills)
        # trainer kills at evenly spaced steps of the final timeline's progress, jittered
        gap = self.total_steps / (len(kills) + 1)
        self.plan = [(int(gap * (i + 1) + self.rng.uniform(-0.3, 0.3) * (gap - cfg.every - 1)), k)
                     for i, k in enumerate(kills)]
        # epoch-end chains: armed a few steps before the end of epochs 1, 2, ... (their own kind, in step order)
        ends = [e * self.epoch_steps for e in range(1, cfg.epochs)][:cfg.epoch_end_resumes]
        self.plan = sorted(self.plan + [(max(0, end - 2), f"epoch_end@{end}") for end in ends])
        self.save_points = 0
        # worker kills and remote replacements paced by steps trained (history), which only grows
        # (spaced over the final timeline's steps, so the quotas are met before its end despite rollbacks)
        self.worker_gap = max(1, self.total_steps // (cfg.worker_kills + 2)) if cfg.worker_kills else None
        self.remote_gap = max(1, self.total_steps // (cfg.remote_kills + 2)) if cfg.remote_kills else None
        self.next_worker_kill = self.worker_gap or 0
        self.next_remote_kill = self.remote_gap or 0
        self.remote_seq = 0

    # -- processes -------------------------------------------------------------------------------------------------
    def _popen(self, argv: list[str], name: str) -> subprocess.Popen:
        out = open(self.run / "logs" / f"{name}.log", "ab")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        try:
            return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    cwd=REPO)
        finally:
            out.close()

    def start_trainer(self, resume: bool) -> None:
        argv = [sys.executable, "-m", "benchmarks._chaos_trainer", "--run-dir", str(self.run), "--port",
                str(self.port), "--prompts", str(self.cfg.prompts), "--workers", str(self.cfg.workers),
                "--every", str(self.cfg.every), "--step-sleep-s", str(self.cfg.step_sleep_s),
                "--epochs", str(self.cfg.epochs)]
        self.trainer = self._popen(argv + (["--resume"] if resume else []), f"trainer-{len(self.trainers)}")
        self.trainers.append(self.trainer)
        self.phase_start, self.phase_step = time.monotonic(), last_step(self.run / "consumed.jsonl")

    def start_remote(self) -> None:
        config = {"worker": dataclasses.asdict(T.worker_config(str(self.run / "weights"))),
                  "transport": {**dataclasses.asdict(T.transport_config(self.port)),
                                "peer_timeout_s": REMOTE_PEER_TIMEOUT_S}}
        argv = [sys.executable, "-m", "asyncrl.cli", "worker", "--connect", self.endpoint, "--worker-id",
                f"remote-{self.remote_seq}", "--config-json", json.dumps(config)]
        self.remotes.append(self._popen(argv, f"remote-{self.remote_seq}"))
        self.all_remotes.append(self.remotes[-1])
        self.remote_seq += 1
        self.counts["remote_started"] += 1

    def start_rogue(self) -> None:
        if self.cfg.hostile <= 0:
            return
        argv = [sys.executable, "-m", "benchmarks._chaos_rogue", "--endpoint", self.endpoint, "--out",
                str(self.run / "rogue.json"), "--prompts", str(self.cfg.prompts), "--group-size", str(T.GROUP_SIZE),
                "--rate", str(self.cfg.rate), "--frames", str(self.cfg.hostile), "--storm-s", str(self.cfg.storm_s),
                "--steal-id", f"{T.WORKER_PREFIX}-0", "--max-message-bytes", str(T.MAX_MESSAGE_BYTES),
                "--seed", str(self.cfg.seed)]
        self.rogue = self._popen(argv, "rogue")

    def local_workers(self) -> tuple[list[int], list[int]]:
        """(every local worker pid any trainer started, those of the current trainer that are alive)."""
        every, current = [], []
        for path in (self.run / "pids").glob("*.json"):
            try:
                info = json.loads(path.read_text())
            except ValueError:
                continue
            every += info["workers"]
            if self.trainer is not None and info["trainer"] == self.trainer.pid:
                current = [p for p in info["live"] if p is not None and alive(p)]
        return every, current

    def kill_trainer(self, why: str) -> None:
        _, workers = self.local_workers()
        os.kill(self.trainer.pid, signal.SIGKILL)
        self.trainer.wait()
        now = time.monotonic()
        self.orphans += [(p, now) for p in workers]
        self.events.append({"t": round(now - self.t0, 2), "event": "trainer_killed", "why": why,
                            "step": last_step(self.run / "consumed.jsonl")})
        for name in ("pause-request", "paused.json"):
            (self.run / name).unlink(missing_ok=True)

    # -- the run ---------------------------------------------------------------------------------------------------
    def progress(self) -> int:
        return last_step(self.run / "consumed.jsonl")

    def trained(self) -> int:
        try:
            return sum(1 for _ in open(self.run / "history.jsonl", "rb"))
        except FileNotFoundError:
            return 0

    def tick(self) -> bool:
        """One pass of the event loop; False once the run is over (done or out of time)."""
        cfg, now = self.cfg, time.monotonic()
        self._check_orphans(now)
        self.remotes = [p for p in self.remotes if p.poll() is None or self._remote_exited(p)]
        rc = self.trainer.poll()
        if rc is not None:
            if rc == 0 and (self.run / "done.json").exists():
                return False
            log = f"logs/trainer-{len(self.trainers) - 1}.log"
            self.crashes.append({"rc": rc, "step": self.progress(), "log": log})
            self.log(f"chaos: trainer exited with {rc} at step {self.progress()}; resuming")
            if len(self.crashes) > 5:
                return False
            self.start_trainer(resume=True)
            return True
        if now - self.t0 > cfg.run_deadline_s:
            self.hangs.append({"what": "run deadline", "step": self.progress()})
            return False
        step, trained = self.progress(), self.trained()
        if step != self.phase_step:
            self.phase_start, self.phase_step = now, step
        elif now - self.phase_start > cfg.phase_deadline_s:
            self.hangs.append({"what": f"no progress for {cfg.phase_deadline_s} s", "step": step})
            self.kill_trainer("hang")
            self.start_trainer(resume=True)
            return True
        if step >= self.total_steps - 1:
            return True  # let the epoch end in peace: no new faults at its very end
        if self.plan and step >= self.plan[0][0]:
            _, kind = self.plan.pop(0)
            if kind == "trainer":
                time.sleep(self.rng.uniform(0, 0.3))  # a random moment inside a step
                self.kill_trainer("random")
                self.counts["trainer_kills"] += 1
            elif kind.startswith("epoch_end@"):
                self._epoch_end_chain(int(kind.split("@")[1]))
                return True
            else:
                self._kill_in_save()
            self.start_trainer(resume=True)
            return True
        if self.worker_gap and trained >= self.next_worker_kill and self.counts["worker_kills"] < cfg.worker_kills:
            _, workers = self.local_workers()
            if workers:
                os.kill(self.rng.choice(workers), signal.SIGKILL)
                self.counts["worker_kills"] += 1
                self.next_worker_kill = trained + self.worker_gap
        if self.remote_gap and trained >= self.next_remote_kill and self.counts["remote_kills"] < cfg.remote_kills:
            live = [p for p in self.remotes if p.poll() is None]
            if live:
                victim = self.rng.choice(live)
                victim.kill()
                victim.wait()
                self.counts["remote_kills"] += 1
            self.next_remote_kill = trained + self.remote_gap
        while len([p for p in self.remotes if p.poll() is None]) < cfg.remote_workers:
            self.start_remote()
        return True

    def _remote_exited(self, p: subprocess.Popen) -> bool:
        self.counts[f"remote_exit_rc{p.returncode}"] += 1  # PeerLost while the trainer was down: rc 1
        return False

    def _kill_in_save(self) -> None:
        point = SAVE_KILL_POINTS[self.save_points % len(SAVE_KILL_POINTS)]
        self.save_points += 1
        self._kill_when_paused(point)
        self.counts["save_kills"] += 1
        self.counts[f"save_kill_{point}"] += 1

    def _epoch_end_chain(self, end: int) -> None:
        """SIGKILL right after the checkpoint of the epoch's last step ``end``, resume; SIGKILL right after the
        resumed trainer's next checkpoint (inside the next epoch), resume again."""
        self._kill_when_paused("pruned", step=end)
        self.start_trainer(resume=True)
        self._kill_when_paused("pruned")
        self.start_trainer(resume=True)
        self.counts["epoch_end_resumes"] += 1

    def _kill_when_paused(self, point: str, step: int | None = None) -> None:
        """Asks the trainer to pause at ``point`` of its next save (of ``step``, if given), then SIGKILLs it there."""
        (self.run / "pause-request").write_text(point if step is None else f"{point}@{step}")
        deadline = time.monotonic() + self.cfg.phase_deadline_s
        paused = self.run / "paused.json"
        while time.monotonic() < deadline and self.trainer.poll() is None:
            try:
                info = json.loads(paused.read_text())
                if info["pid"] == self.trainer.pid and info["point"] == point and step in (None, info["step"]):
                    break
            except (FileNotFoundError, ValueError):
                pass
            time.sleep(0.02)
        else:
            self.hangs.append({"what": f"save never reached {point}" + (f" of step {step}" if step else ""),
                               "step": self.progress()})
        self.kill_trainer(f"in save at {point}" + (f" of step {step}" if step else ""))

    def _check_orphans(self, now: float) -> None:
        keep = []
        for pid, since in self.orphans:
            if not alive(pid):
                self.orphan_max_s = max(self.orphan_max_s, now - since)
            elif now - since > self.cfg.orphan_deadline_s:
                self.orphan_outlived.append(pid)
            else:
                keep.append((pid, since))
        self.orphans = keep

    def run_all(self) -> dict[str, Any]:
        try:
            self.start_trainer(resume=False)
            self.start_rogue()
            while self.tick():
                time.sleep(0.1)
            return self.finish()
        finally:
            self.cleanup()

    def finish(self) -> dict[str, Any]:
        """Waits (bounded) for everything to end on its own, then counts what did not."""
        deadline = time.monotonic() + 30
        if self.trainer.poll() is None:
            self.hangs.append({"what": "trainer still running at the end", "step": self.progress()})
        if self.rogue is not None:
            self.rogue.terminate()  # SIGTERM: it writes its counts and exits
            try:
                self.rogue.wait(15)
            except subprocess.TimeoutExpired:
                self.hangs.append({"what": "rogue did not stop on SIGTERM"})
        while time.monotonic() < deadline and (self.orphans or any(p.poll() is None for p in self.remotes)):
            self._check_orphans(time.monotonic())
            time.sleep(0.1)
        self._check_orphans(time.monotonic() + self.cfg.orphan_deadline_s + 1)
        every_local, _ = self.local_workers()
        pids = {p.pid for p in [*self.trainers, *self.all_remotes]} | set(every_local)
        pids |= {self.rogue.pid} if self.rogue is not None else set()
        leftover = sorted(p for p in pids if alive(p))
        remotes_left = [p.pid for p in self.remotes if p.poll() is None]
        return {"leftover_pids": leftover, "remote_workers_not_shut_down": remotes_left,
                "processes_tracked": len(pids), "local_workers_started": len(set(every_local))}

    def cleanup(self) -> None:
        """Ends whatever we started that still runs, by pid (local workers end with their trainer)."""
        for p in [*self.trainers, *self.all_remotes, *([self.rogue] if self.rogue else [])]:
            if p.poll() is None:
                p.kill()
                p.wait()


def _valid_on_timeline(inc: str, pv: int, live: str, version: int, lineage: dict[str, dict[str, Any]]) -> bool:
    """``(inc, pv)`` names weights the history of ``live`` at ``version`` really had: walk its ancestors."""
    cur, upper = live, version
    while cur is not None and cur in lineage:
        start = lineage[cur]["start_version"]
        if inc == cur and start <= pv <= upper:
            return True
        cur, upper = lineage[cur]["parent"], start  # the parent's segment ends where this one forked
    return False


def account(run_dir: Path, prompts: int, rogue: dict[str, Any] | None = None, epochs: int = 1) -> dict[str, Any]:
    """The exactly-once figures of a finished run, from its logs (see the module docstring)."""
    consumed, history = read_lines(run_dir / "consumed.jsonl"), read_lines(run_dir / "history.jsonl")
    lineage = {row["incarnation"]: row for row in read_lines(run_dir / "lineage.jsonl")}
    counts = collections.Counter(g for row in consumed for g in row["group_ids"])
    expected = {f"e{e}-p{i}" for e in range(epochs) for i in range(prompts)}
    steps = [row["step"] for row in consumed]
    leased = {f"e{e}-p{i}" for e, i in (rogue or {}).get("leased_to_rogue", [])}
    bad: collections.Counter[str] = collections.Counter()
    for row in history:
        v, live = row["version"], row["incarnation"]
        for inc, pv in row["pairs"]:
            if pv > v:
                bad["ahead_of_trainer"] += 1
            elif v - pv > T.MAX_STALENESS:
                bad["above_staleness_bound"] += 1
            if not inc:
                bad["no_incarnation"] += 1
            elif not _valid_on_timeline(inc, pv, live, v, lineage):
                bad["dead_timeline"] += 1
        for gid, workers in zip(row["group_ids"], row["group_workers"]):
            if any(w.startswith("forged") for w in workers):
                bad["forged_leased_to_rogue" if gid in leased else "forged"] += 1
        lo, hi = row["token_range"]
        if not (row["max_abs_reward"] <= 1e6 and 0 <= lo and hi < T.VOCAB_SIZE and row["min_logprob"] >= -1e4):
            bad["out_of_range_batches"] += 1
    return {
        "groups_expected": len(expected),
        "groups_consumed": sum(counts.values()),
        "groups_lost": len(expected - set(counts)),
        "groups_consumed_twice": sum(n - 1 for n in counts.values() if n > 1),
        "groups_unexpected": len(set(counts) - expected),
        "steps_final_timeline": len(steps),
        "step_sequence_ok": steps == list(range(1, len(steps) + 1)),
        "batches_trained_all_incarnations": len(history),
        "rollout_versions_above_staleness_bound": bad["above_staleness_bound"],
        "rollout_versions_ahead_of_trainer": bad["ahead_of_trainer"],
        "rollout_versions_dead_timeline": bad["dead_timeline"],
        "rollout_versions_without_incarnation": bad["no_incarnation"],
        "forged_groups_consumed": bad["forged"],
        "forged_groups_consumed_after_a_real_lease": bad["forged_leased_to_rogue"],
        "batches_out_of_gate_ranges": bad["out_of_range_batches"],
        "incarnations": len(lineage),
        "resumes_with_fallback": sum(1 for r in lineage.values() if r.get("note")),
    }


def counters(run_dir: Path) -> dict[str, Any]:
    """The pool's counters: pool and ledger from the final incarnation (carried along the final timeline by
    checkpoints), transport summed over incarnations from each one's last snapshot (every 5 steps)."""
    transport: collections.Counter[str] = collections.Counter()
    for path in (run_dir / "stats").glob("*.json"):
        try:
            stats = json.loads(path.read_text())
        except ValueError:
            continue
        transport.update({k: v for k, v in stats["transport"].items() if isinstance(v, int)})
    done = json.loads((run_dir / "done.json").read_text())["stats"] if (run_dir / "done.json").exists() else {}
    return {"pool": done.get("pool", {}), "ledger": done.get("ledger", {}), "transport": dict(transport),
            "workers": done.get("workers")}


def verdict(figures: dict[str, Any], procs: dict[str, Any], hangs: list[Any]) -> dict[str, bool]:
    return {
        "groups_lost_0": figures["groups_lost"] == 0,
        "consumed_twice_0": figures["groups_consumed_twice"] == 0 and figures["groups_unexpected"] == 0,
        "staleness_and_timeline_0": not (figures["rollout_versions_above_staleness_bound"]
                                         or figures["rollout_versions_ahead_of_trainer"]
                                         or figures["rollout_versions_dead_timeline"]),
        "forged_consumed_0": figures["forged_groups_consumed"] == 0 and figures["batches_out_of_gate_ranges"] == 0,
        "hangs_0": not hangs,
        "leftover_processes_0": not procs["leftover_pids"],
        "steps_contiguous": figures["step_sequence_ok"],
    }


def run_chaos(cfg: ChaosConfig, run_dir: Path, log=print) -> dict[str, Any]:
    """Runs the chaos run and returns its result (figures, counters, verdict, events)."""
    h = Harness(cfg, run_dir, log)
    started = time.monotonic()
    procs = h.run_all()
    rogue = json.loads((run_dir / "rogue.json").read_text()) if (run_dir / "rogue.json").exists() else None
    figures = account(run_dir, cfg.prompts, rogue, epochs=cfg.epochs)
    figures.update({
        "worker_kills": h.counts["worker_kills"], "remote_kills": h.counts["remote_kills"],
        "remote_workers_started": h.counts["remote_started"],
        "trainer_kills": h.counts["trainer_kills"], "save_kills": h.counts["save_kills"],
        "epoch_end_resumes": h.counts["epoch_end_resumes"],
        "save_kills_by_point": {p: h.counts[f"save_kill_{p}"] for p in SAVE_KILL_POINTS},
        "hostile_messages": rogue["hostile_messages"] if rogue else 0,
        "forged_groups_sent": rogue["forged_groups"] if rogue else 0,
        "hostile_by_kind": rogue["counts"] if rogue else {},
        "worker_id_hijacks": rogue["hijacks"] if rogue else 0,
        "hangs": len(h.hangs), "trainer_crashes": len(h.crashes),
        "orphans_outlived_deadline": len(h.orphan_outlived), "orphan_slowest_exit_s": round(h.orphan_max_s, 2),
        "leftover_processes": len(procs["leftover_pids"]), "wall_s": round(time.monotonic() - started, 1),
        **{k: v for k, v in procs.items() if k != "leftover_pids"},
        "remote_exits": {k: v for k, v in h.counts.items() if k.startswith("remote_exit")},
    })
    ok = verdict(figures, procs, h.hangs + [{"orphans": h.orphan_outlived}] * bool(h.orphan_outlived))
    return {"figures": figures, "verdict": ok, "ok": all(ok.values()), "counters": counters(run_dir),
            "hangs": h.hangs, "crashes": h.crashes, "leftover_pids": procs["leftover_pids"], "events": h.events}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = ChaosConfig()
    for f in dataclasses.fields(ChaosConfig):
        p.add_argument(f"--{f.name.replace('_', '-')}", type=type(getattr(defaults, f.name)),
                       default=getattr(defaults, f.name))
    p.add_argument("--out", help="result JSON (default benchmarks/results/chaos-DATE.json)")
    p.add_argument("--run-dir", help="keep the run directory here (default: a temporary one, removed)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM (a stopped run) unwinds through Harness.cleanup: every process we started ends, by pid
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("chaos: SIGTERM; stopping what it started"))
    cfg = ChaosConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ChaosConfig)})
    date = dt.datetime.now(dt.timezone.utc)
    out = Path(args.out or REPO / "benchmarks" / "results" / f"chaos-{date:%Y-%m-%d}.json")
    with tempfile.TemporaryDirectory(prefix="chaos-") as tmp:
        run_dir = Path(args.run_dir) if args.run_dir else Path(tmp)
        run_dir.mkdir(parents=True, exist_ok=True)
        load = os.getloadavg()
        result = run_chaos(cfg, run_dir)
        doc = {"benchmark": "chaos", "argv": sys.argv, "config": dataclasses.asdict(cfg), "machine": machine(),
               "commit": git_commit(), "date": date.isoformat(timespec="seconds"),
               "loadavg_before": load, "loadavg_after": os.getloadavg(), **result}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(json.dumps({"ok": doc["ok"], "verdict": doc["verdict"], "figures": doc["figures"]}, indent=1))
    print(f"wrote {out}")
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

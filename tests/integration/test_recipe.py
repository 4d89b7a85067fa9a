"""The GRPO recipe under torchrun (2 gloo ranks, real HF rollout workers, real weight sync):
learning, disjoint data per rank, SIGKILL + --resume (exactly once, and step-for-step equal losses
in the reproducible regime), the update guard, and LoRA-only sync."""

from __future__ import annotations

import collections
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).parents[2]
CONFIG = ROOT / "recipes" / "configs" / "tiny_cpu.yaml"
# The reproducible regime: on-policy, batches in ledger order, samples seeded per prompt and version.
EXACT = ["rollout.max_staleness=0", "rollout.ordered=true", "rollout.worker.engine.seed_per_prompt=true"]
SMALL = ["data.num_prompts=64", "rollout.batch_size=4", "rollout.group_size=4", "train.sft_steps=20"]


def _torchrun(run_dir: Path, *overrides: str, nproc: int = 2, resume: bool = False,
              report: bool = False) -> subprocess.Popen:
    """``report``: the end-of-run report.png and report/index.html (seconds of matplotlib; the learning test checks
    them)."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            str(ROOT / "recipes" / "grpo.py"), "--config", str(CONFIG), f"run_dir={run_dir}",
            f"debug.report={str(report).lower()}", *overrides]
    if resume:
        argv.insert(argv.index("--config"), "--resume")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    # a session of its own: the whole run (torchrun, ranks, workers) can be ended together, by process group
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _finish(proc: subprocess.Popen, timeout: float = 600) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_run(proc)
        pytest.fail("recipe timed out")
    assert proc.returncode == 0, out[-4000:]
    return out


def _kill_run(proc: subprocess.Popen) -> None:
    """Ends torchrun and the ranks it started, by pid."""
    from recipes.grpo import end_run

    end_run(proc, Path(next(a for a in proc.args if a.startswith("run_dir=")).split("=", 1)[1]))


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _consumed(run_dir: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (run_dir / f"consumed-rank{rank}.jsonl").read_text().splitlines()]


def test_two_ranks_learn_on_disjoint_data(tmp_path):
    # The reproducible regime: async runs of this tiny task learn in most runs but not all (one fresh-clone
    # run went 0.593 -> 0.588), so the direction is tested where the run is a function of the seed alone.
    # 60 of the config's 150 steps (the learning rate is constant after warm-up, so a shorter run is the longer one's
    # prefix): 0.604 -> 0.682 over the last 30 steps (150 steps: 0.726 over the last 45), twice the margin asserted.
    run = tmp_path / "run"
    _finish(_torchrun(run, *EXACT, "train.steps=60", report=True))
    rows = _metrics(run)
    assert len(rows) == 60 and all(r["accepted"] for r in rows)
    first, last = statistics.mean(r["reward_mean"] for r in rows[:15]), statistics.mean(r["reward_mean"] for r in rows[-30:])
    print(f"reward: first 15 steps {first:.3f}, last 30 steps {last:.3f}")
    assert last > first + 0.04, f"reward did not rise: {first:.3f} -> {last:.3f}"
    ranks = [{g for rec in _consumed(run, r) for g in rec["group_ids"]} for r in (0, 1)]
    assert ranks[0].isdisjoint(ranks[1])
    assert (run / "report.png").stat().st_size > 0
    assert max(r["staleness_max"] for r in rows) == 0  # max_staleness=0
    # the debugger on a healthy run: every step recorded on every rank, no detector fires, the run wrote its report
    from asyncrl.debug.record import read_records
    from tests._synthetic_run import parse_page

    for rank in (0, 1):
        records = read_records(run / "debug" / f"steps-rank{rank}.jsonl")
        assert [r["step"] for r in records] == list(range(1, 61))
        assert max(max(abs(r["dist"]["logprob_diff_onpolicy"]["min"]), r["dist"]["logprob_diff_onpolicy"]["max"])
                   for r in records) < 1e-4  # fp32 engine vs trainer, on-policy
    anomalies = run / "debug" / "anomalies.jsonl"
    assert not anomalies.exists() or not anomalies.read_text().strip(), anomalies.read_text()[:2000]
    assert not (run / "dumps").exists()
    sections, _ = parse_page((run / "report" / "index.html").read_text())
    assert {"summary", "curves", "staleness", "logprobs", "guard", "anomalies", "throughput"} <= set(sections)
    assert "none" in sections["anomalies"].text.lower()


def test_sigkill_and_resume_trains_each_group_once_with_identical_losses(tmp_path):
    steps = ["train.steps=8", "checkpoint.every=4", *EXACT, *SMALL]  # 64 prompts / 2 ranks / 4 groups = 8 steps
    run = tmp_path / "run"
    proc = _torchrun(run, *steps, "testing.pause_after_step=7")
    deadline = time.monotonic() + 600
    while len(_metrics(run)) < 7:  # past the step-4 checkpoint: steps 5-7 will be lost and redone
        assert proc.poll() is None and time.monotonic() < deadline, "run ended before it could be killed"
        time.sleep(0.05)
    # the reference: steps 1-7 of this run, uninterrupted so far (the resume must redo 5-7 with the same losses)
    reference = {r["step"]: r for r in _metrics(run)}
    pids = {rank: (run / f"pid-rank{rank}").read_text() for rank in (0, 1)}
    # one run per run directory: a second one (here a --resume, on one rank: the lock is taken before the world size
    # matters) is refused at once, with the holder named
    second = _torchrun(run, *steps, nproc=1, resume=True)
    out, _ = second.communicate(timeout=300)
    assert second.returncode != 0, out[-3000:]
    assert f"is in use by another run (pid {pids[0]} on " in out, out[-3000:]
    assert {rank: (run / f"pid-rank{rank}").read_text() for rank in (0, 1)} == pids  # it wrote nothing
    assert len(_metrics(run)) >= 5 and proc.poll() is None  # and the holder trains on, untouched
    # SIGKILL torchrun's whole process group mid-run: the ranks (each in a session of its own, so the kill misses
    # them) and their rollout workers must leave with it (asyncrl.lifeline; before: orphaned ranks trained on and
    # moved latest). test_killing_torchrun_ends_its_ranks_and_their_workers (extended) kills a run that is not paused.
    _kill_torchrun_and_expect_its_ranks_and_workers_gone(proc, {int(pid) for pid in pids.values()})
    assert (run / "checkpoints" / "latest").read_text() == "step-000004"
    assert max(r["step"] for r in _metrics(run)) >= 7  # steps 5-7 logged, then rolled back by the resume
    half_written = run / "checkpoints" / ".step-000008.tmp"  # what a crash in the middle of a save leaves
    half_written.mkdir()
    (half_written / "loader-rank0.pt").write_bytes(b"truncated")

    _finish(_torchrun(run, *steps, resume=True))  # the killed holder's lock went with it
    _assert_each_step_recorded_once(run, steps=8)
    groups = collections.Counter(g for r in (0, 1) for rec in _consumed(run, r) for g in rec["group_ids"])
    assert set(groups) == {f"e0-p{i}" for i in range(64)} and max(groups.values()) == 1

    redone = [r for r in _metrics(run) if r["step"] in (5, 6, 7)]
    assert len(redone) == 3
    for r in redone:
        assert r["loss"] == pytest.approx(reference[r["step"]]["loss"], abs=1e-6), f"step {r['step']}"
        assert r["reward_mean"] == pytest.approx(reference[r["step"]]["reward_mean"], abs=1e-6)


def _assert_each_step_recorded_once(run: Path, steps: int) -> None:
    """The run's records after a resume: every step 1..steps exactly once in metrics.jsonl and in each rank's
    consumed and debug records, each anomaly at most once (the rolled-back steps' lines were removed)."""
    from asyncrl.debug.record import read_records

    expected = list(range(1, steps + 1))
    assert [r["step"] for r in _metrics(run)] == expected
    for rank in (0, 1):
        assert [r["step"] for r in _consumed(run, rank)] == expected, f"consumed-rank{rank}.jsonl"
        assert [r["step"] for r in read_records(run / "debug" / f"steps-rank{rank}.jsonl")] == expected
    anomalies = run / "debug" / "anomalies.jsonl"
    if anomalies.exists():
        lines = collections.Counter((a["step"], a["rank"], a["kind"]) for a in map(json.loads, anomalies.read_text().splitlines()))
        assert not lines or max(lines.values()) == 1, lines


def test_a_kill_inside_the_final_save_resumes_from_a_complete_checkpoint(tmp_path):
    # checkpoint.every=1 used to save the final step twice, the second time rmtree-ing the step-N that latest
    # named before replacing it: a kill in that gap left latest naming nothing. Kill inside the final save,
    # after its step-N is renamed into place but before latest moves, then resume. Under FSDP2: the same run proves
    # that FSDP2 trains, checkpoints (sharded) and resumes (DDP's resume: the SIGKILL test above).
    steps = ["train.steps=4", "checkpoint.every=1", "checkpoint.keep=2", "train.parallel=fsdp2", *SMALL]
    run = tmp_path / "run"
    ckpt = run / "checkpoints"
    proc = _torchrun(run, *steps, "testing.pause_in_save_at_step=4", "testing.pause_in_save_point=renamed")
    deadline = time.monotonic() + 600
    while not (ckpt / "step-000004").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "run ended before it could be killed in the save"
        time.sleep(0.05)
    _kill_run(proc)
    assert (ckpt / "latest").read_text() == "step-000003"  # the renamed step-4 is complete but not named
    out = _finish(_torchrun(run, *steps, resume=True))
    assert "resumed from" in out and "at step 3" in out, out[-3000:]
    # step 4 trained again and saved once, under a new name (nothing latest named was touched)
    assert (ckpt / "latest").read_text() == "step-000004.1"
    from asyncrl.checkpoint.checkpointer import CheckpointDir

    assert CheckpointDir(ckpt, world_size=2).why_incomplete(ckpt / "step-000004.1") is None
    assert sorted(p.name for p in ckpt.glob("step-*")) == ["step-000004", "step-000004.1"]  # keep=2, by commit
    _assert_each_step_recorded_once(run, steps=4)
    assert all(r["accepted"] for r in _metrics(run))


def test_guard_rejects_nan_batch_restores_exactly_and_dump_replays(tmp_path):
    # one run, two rejections: step 3's NaN rewards (injected), step 4's NaN from a user loss.fn (REINFORCE, its
    # metrics logged), which goes through the same guard (tests/integration/test_recipe_losses.py has it alone)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from recipes.grpo import load_config, replay_rejection

    overrides = ["train.steps=4", "testing.inject_nan_at_step=3", "checkpoint.every=1", "checkpoint.keep=10", *SMALL,
                 "loss.fn=tests.integration.test_recipe_losses:nan_on_the_fourth_step"]
    run = tmp_path / "run"
    _finish(_torchrun(run, *overrides))
    assert not (run / "report.png").exists() and not (run / "report").exists()  # debug.report=false (_torchrun's)
    rows = {r["step"]: r for r in _metrics(run)}
    assert [rows[s]["accepted"] for s in (1, 2, 3, 4)] == [True, True, False, False]
    assert "non-finite" in rows[3]["guard_reason"] and "non-finite" in rows[4]["guard_reason"]
    assert rows[1]["loss/tokens"] > 0  # the user loss's own metrics
    assert [rows[s]["policy_version"] for s in (1, 2, 3, 4)] == [1, 2, 2, 2]

    def state(step: int) -> dict:
        dcp_to_torch_save(str(run / "checkpoints" / f"step-{step:06d}"), str(tmp_path / f"s{step}.pt"))
        return torch.load(tmp_path / f"s{step}.pt", weights_only=False)

    for before, after in ((state(2), state(3)), (state(3), state(4))):  # each rejected update restored bit for bit
        for section in ("model", "optim"):
            flat_b, flat_a = _flatten(before[section]), _flatten(after[section])
            assert flat_b.keys() == flat_a.keys()
            for key in flat_b:
                if isinstance(flat_b[key], torch.Tensor):
                    assert torch.equal(flat_b[key], flat_a[key]), f"{section}.{key} changed by a rejected update"
                else:
                    assert flat_b[key] == flat_a[key], f"{section}.{key}"
    assert sorted((run / "dumps").glob("step-000004-rank*.msgpack"))  # the user loss's rejected batch, dumped
    dumps = sorted((run / "dumps").glob("step-000003-rank*.msgpack"))
    assert len(dumps) == 2
    cfg = load_config(str(CONFIG), [f"run_dir={run}", *overrides])
    reason = replay_rejection(dumps[0], run / "checkpoints" / "step-000002", cfg, str(run / "model"))
    assert reason.startswith("non-finite")


def _flatten(tree, prefix: str = "") -> dict:
    out = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}{k}."))
    else:
        out[prefix] = tree
    return out


def test_lora_syncs_only_the_adapter(tmp_path):
    run = tmp_path / "run"
    _finish(_torchrun(run, "lora.rank=8", "train.lr=0.003", "train.steps=4", "checkpoint.every=0", *SMALL))
    _assert_only_the_adapter_was_sent(run, _metrics(run))


@pytest.mark.extended  # make test: the adapter-only sync above (4 steps); full fine-tuning learns in the first test
def test_lora_syncs_only_the_adapter_and_learns(tmp_path):
    run = tmp_path / "run"
    # 60 steps (a prefix of the 90 this test ran before: constant learning rate after warm-up): 0.579 -> 0.647
    _finish(_torchrun(run, "lora.rank=8", "train.lr=0.003", "train.steps=60", "checkpoint.every=0", *EXACT))
    rows = _metrics(run)
    first, last = statistics.mean(r["reward_mean"] for r in rows[:15]), statistics.mean(r["reward_mean"] for r in rows[-30:])
    print(f"LoRA reward: first 15 steps {first:.3f}, last 30 steps {last:.3f}")
    assert last > first + 0.04, f"LoRA reward did not rise: {first:.3f} -> {last:.3f}"
    _assert_only_the_adapter_was_sent(run, rows)


def _assert_only_the_adapter_was_sent(run: Path, rows: list[dict]) -> None:
    """Every accepted step published the rank-8 adapter's bytes, under a fifth of the full model's."""
    assert rows and any(r["accepted"] for r in rows)
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run / "model")
    full = sum(t.nbytes for t in model.state_dict().values())
    adapter = get_peft_model_state_dict(get_peft_model(model, LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])))
    adapter_bytes = sum(t.nbytes for t in adapter.values())
    sent = {r["weight_bytes"] for r in rows if r["accepted"]}
    assert sent == {adapter_bytes}, (sent, adapter_bytes, full)
    assert adapter_bytes < full / 5


@pytest.mark.extended  # make test runs this loop in test_drop_in_resume.py (8 steps across a SIGKILL and a --resume)
def test_drop_in_loop_runs(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "drop_in.py"), "--steps", "3", "--run-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("step ") == 3


@pytest.mark.extended  # make test: the kill-inside-the-final-save test runs under FSDP2 (trains, saves, resumes)
def test_fsdp2_trains_checkpoints_and_resumes(tmp_path):
    run = tmp_path / "run"
    common = ["train.parallel=fsdp2", "checkpoint.every=2", *SMALL]
    _finish(_torchrun(run, "train.steps=4", *common))
    out = _finish(_torchrun(run, "train.steps=6", *common, resume=True))
    assert "resumed from" in out and "step 4" in out
    rows = _metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6] and all(r["accepted"] for r in rows)


def _descendants(pid: int) -> set[int]:
    """Every live descendant of ``pid`` (the rollout workers a rank started), from /proc."""
    parents: dict[int, list[int]] = collections.defaultdict(list)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
                continue
            parents[ppid].append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _lines(path: Path) -> int:
    """Complete lines written so far (a line being written is not counted, nor parsed)."""
    return path.read_bytes().count(b"\n") if path.exists() else 0


def _alive(pid: int) -> bool:
    """Exists and is not a zombie (an orphan's zombie waits for init, not for us)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _kill_torchrun_and_expect_its_ranks_and_workers_gone(proc: subprocess.Popen, ranks: set[int]) -> set[int]:
    """SIGKILLs torchrun's process group (``_torchrun`` starts it in a session of its own) and asserts that the ranks
    and every rollout worker they started are gone within 30 s; returns the workers' pids."""
    workers = set().union(*(_descendants(pid) for pid in ranks))
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()  # not communicate(): orphaned ranks would hold its stdout open
    survivors = ranks | workers
    try:
        assert len(workers) >= len(ranks), f"expected a rollout worker per rank, found {workers}"
        deadline = time.monotonic() + 30
        while any(map(_alive, survivors)) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = {pid for pid in survivors if _alive(pid)}
        assert not left, f"still running {time.monotonic() - deadline + 30:.0f} s after torchrun was killed: {left}"
    finally:
        for pid in survivors:  # what we started, by pid, if the lifeline failed
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.stdout.close()
    print(f"ranks {sorted(ranks)} and workers {sorted(workers)} gone")
    return workers


@pytest.mark.extended  # make test: test_sigkill_and_resume_... kills torchrun's process group the same way, paused at
# step 7, with the same check (ranks and workers gone within 30 s), then resumes the run
def test_killing_torchrun_ends_its_ranks_and_their_workers(tmp_path):
    # torchrun starts each rank in a session of its own: SIGKILL of torchrun's process group used to leave both
    # ranks and their rollout workers training on (69 more steps in one run, latest moved from 40 to 130)
    run = tmp_path / "run"
    ckpt = run / "checkpoints"
    proc = _torchrun(run, "train.steps=100000", "checkpoint.every=5", "train.sft_steps=0", "rollout.batch_size=4",
                     "rollout.group_size=4")
    survivors: set[int] = set()
    try:
        deadline = time.monotonic() + 600
        # past the step-5 checkpoint, the next one 5 steps away (more than the one step in flight allowed below)
        while _lines(run / "metrics.jsonl") < 6 or not (ckpt / "latest").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "run ended before it could be killed"
            time.sleep(0.05)
        ranks = {int((run / f"pid-rank{r}").read_text()) for r in (0, 1)}
        workers = set().union(*(_descendants(pid) for pid in ranks))
        assert len(workers) >= 2, f"expected a rollout worker per rank, found {workers}"
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun's whole process group (it runs in a session of its own)
        latest = (ckpt / "latest").read_text()
        steps_at_kill = _lines(run / "metrics.jsonl")
        proc.wait()  # not communicate(): orphaned ranks would hold its stdout open
        survivors = ranks | workers
        deadline = time.monotonic() + 30
        while any(map(_alive, survivors)) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = {pid for pid in survivors if _alive(pid)}
        assert not left, f"still running {time.monotonic() - deadline + 30:.0f} s after torchrun was killed: {left}"
        assert (ckpt / "latest").read_text() == latest, "orphaned ranks moved latest"
        assert _lines(run / "metrics.jsonl") <= steps_at_kill + 1, "orphaned ranks trained on"  # + a step in flight at the kill
        print(f"ranks {sorted(ranks)} and workers {sorted(workers)} gone; latest stayed {latest}")
    finally:
        for pid in survivors:  # what we started, by pid, if the fix failed
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            _kill_run(proc)
        proc.stdout.close()


@pytest.mark.extended  # one run per run directory, a repeat: make test keeps it on the recipe in
# test_sigkill_and_resume_trains_each_group_once_with_identical_losses (a second launch on a held directory is refused
# at once, naming the holder, writing nothing, the holder untouched), on the library loop in
# test_drop_in_resume.py::test_a_second_drop_in_on_a_held_run_directory_is_refused, and in process in
# tests/unit/checkpoint/test_run_dir.py
def test_a_run_directory_held_by_another_run_is_refused_at_once(tmp_path):
    # the holder here is this test process; a fresh run must leave without writing anything (a --resume refused
    # while a live run holds the directory: test_sigkill_and_resume_trains_each_group_once_with_identical_losses)
    from asyncrl.checkpoint.run_dir import RunDirLock

    run = tmp_path / "run"
    lock = RunDirLock(run)
    lock.acquire(["holder-of-the-test"])
    try:
        proc = _torchrun(run, *SMALL)
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode != 0, out[-3000:]
        assert f"is in use by another run (pid {os.getpid()} on " in out and "holder-of-the-test" in out, out[-3000:]
        assert out.count("[rank 1] run directory") >= 1  # every rank leaves; none waits on the others
        assert sorted(p.name for p in run.iterdir()) == [".lock"]  # no config, pid files, model or records
    finally:
        lock.release()


@pytest.mark.extended  # exactly once across resumes, a repeat (three launches): make test keeps it on the recipe in
# test_sigkill_and_resume_trains_each_group_once_with_identical_losses, and the chain through an epoch end that froze
# the loader state in tests/chaos/test_chaos.py::test_chaos_short (epoch_end_resumes=1: killed and resumed at the
# first epoch's checkpointed end, then again after the next checkpoint, every group of both epochs once)
def test_a_chain_of_resumes_through_an_epoch_end_trains_each_group_once(tmp_path):
    """Run to the end of epoch 0 (its last step is a checkpoint), resume into epoch 1, resume again. The loader
    state used to freeze at the end-of-epoch state after the first resume: step 6's checkpoint held step 4's loader
    state, and the second resume trained epoch 1's first steps again (or waited forever: pool at version 4, trainer
    at 6, every rollout refused as newer than the trainer)."""
    small = ["data.num_prompts=32", "rollout.batch_size=4", "rollout.group_size=4", "train.sft_steps=10",
             "checkpoint.every=2", "rollout.wait_timeout_s=60"]  # 32 prompts / 2 ranks / 4 groups = 4 steps an epoch
    run = tmp_path / "run"
    _finish(_torchrun(run, "train.steps=4", *small))
    _finish(_torchrun(run, "train.steps=6", *small, resume=True))
    _finish(_torchrun(run, "train.steps=8", *small, resume=True))
    _assert_each_step_recorded_once(run, steps=8)
    groups = collections.Counter(g for r in (0, 1) for rec in _consumed(run, r) for g in rec["group_ids"])
    assert max(groups.values()) == 1, [g for g, n in groups.items() if n > 1]
    assert set(groups) == {f"e{e}-p{i}" for e in (0, 1) for i in range(32)}

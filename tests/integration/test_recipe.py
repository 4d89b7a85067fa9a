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


def _torchrun(run_dir: Path, *overrides: str, nproc: int = 2, resume: bool = False) -> subprocess.Popen:
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            str(ROOT / "recipes" / "grpo.py"), "--config", str(CONFIG), f"run_dir={run_dir}", *overrides]
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
    run = tmp_path / "run"
    _finish(_torchrun(run, *EXACT))
    rows = _metrics(run)
    assert len(rows) == 150 and all(r["accepted"] for r in rows)
    first, last = statistics.mean(r["reward_mean"] for r in rows[:15]), statistics.mean(r["reward_mean"] for r in rows[-45:])
    print(f"reward: first 15 steps {first:.3f}, last 45 steps {last:.3f}")
    assert last > first + 0.04, f"reward did not rise: {first:.3f} -> {last:.3f}"
    ranks = [{g for rec in _consumed(run, r) for g in rec["group_ids"]} for r in (0, 1)]
    assert ranks[0].isdisjoint(ranks[1])
    assert (run / "report.png").stat().st_size > 0
    assert max(r["staleness_max"] for r in rows) == 0  # max_staleness=0
    # the debugger on a healthy run: every step recorded on every rank, no detector fires, the report renders
    from asyncrl.debug.record import read_records
    from asyncrl.debug.report import write_report
    from tests._synthetic_run import parse_page

    for rank in (0, 1):
        records = read_records(run / "debug" / f"steps-rank{rank}.jsonl")
        assert [r["step"] for r in records] == list(range(1, 151))
        assert max(max(abs(r["dist"]["logprob_diff_onpolicy"]["min"]), r["dist"]["logprob_diff_onpolicy"]["max"])
                   for r in records) < 1e-4  # fp32 engine vs trainer, on-policy
    anomalies = run / "debug" / "anomalies.jsonl"
    assert not anomalies.exists() or not anomalies.read_text().strip(), anomalies.read_text()[:2000]
    assert not (run / "dumps").exists()
    sections, _ = parse_page(write_report(run).read_text())
    assert {"summary", "curves", "staleness", "logprobs", "guard", "anomalies", "throughput"} <= set(sections)
    assert "none" in sections["anomalies"].text.lower()


def test_sigkill_and_resume_trains_each_group_once_with_identical_losses(tmp_path):
    steps = ["train.steps=8", "checkpoint.every=3", *EXACT, *SMALL]  # 64 prompts / 2 ranks / 4 groups = 8 steps
    reference = tmp_path / "reference"
    _finish(_torchrun(reference, *steps))

    run = tmp_path / "run"
    proc = _torchrun(run, *steps, "train.pause_after_step=5")
    deadline = time.monotonic() + 600
    while len(_metrics(run)) < 5:  # past the step-3 checkpoint: steps 4-5 will be lost and redone
        assert proc.poll() is None and time.monotonic() < deadline, "run ended before it could be killed"
        time.sleep(0.05)
    for rank in (0, 1):  # SIGKILL the trainer ranks mid-run; their workers notice and exit
        os.kill(int((run / f"pid-rank{rank}").read_text()), signal.SIGKILL)
    proc.communicate(timeout=120)
    assert (run / "checkpoints" / "latest").read_text() == "step-000003"
    half_written = run / "checkpoints" / ".step-000006.tmp"  # what a crash in the middle of a save leaves
    half_written.mkdir()
    (half_written / "loader-rank0.pt").write_bytes(b"truncated")
    kept = {r: [rec for rec in _consumed(run, r) if rec["step"] <= 3] for r in (0, 1)}
    lines_before = {r: len(_consumed(run, r)) for r in (0, 1)}
    metrics_before = len(_metrics(run))

    _finish(_torchrun(run, *steps, resume=True))
    resumed = {r: _consumed(run, r)[lines_before[r]:] for r in (0, 1)}
    groups = collections.Counter(g for r in (0, 1) for rec in kept[r] + resumed[r] for g in rec["group_ids"])
    assert set(groups) == {f"e0-p{i}" for i in range(64)} and max(groups.values()) == 1

    ref = {r["step"]: r for r in _metrics(reference)}
    after = _metrics(run)[metrics_before:]
    assert [r["step"] for r in after] == [4, 5, 6, 7, 8]
    for r in after:
        assert r["loss"] == pytest.approx(ref[r["step"]]["loss"], abs=1e-6), f"step {r['step']}"
        assert r["reward_mean"] == pytest.approx(ref[r["step"]]["reward_mean"], abs=1e-6)


def test_guard_rejects_nan_batch_restores_exactly_and_dump_replays(tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from recipes.grpo import load_config, replay_rejection

    overrides = ["train.steps=4", "guard.inject_nan_at_step=3", "checkpoint.every=1", "checkpoint.keep=10", *SMALL]
    run = tmp_path / "run"
    _finish(_torchrun(run, *overrides))
    rows = {r["step"]: r for r in _metrics(run)}
    assert not rows[3]["accepted"] and "non-finite" in rows[3]["guard_reason"]
    assert [rows[s]["policy_version"] for s in (1, 2, 3, 4)] == [1, 2, 2, 3]

    def state(step: int) -> dict:
        dcp_to_torch_save(str(run / "checkpoints" / f"step-{step:06d}"), str(tmp_path / f"s{step}.pt"))
        return torch.load(tmp_path / f"s{step}.pt", weights_only=False)

    before, after = state(2), state(3)
    for section in ("model", "optim"):
        flat_b, flat_a = _flatten(before[section]), _flatten(after[section])
        assert flat_b.keys() == flat_a.keys()
        for key in flat_b:
            if isinstance(flat_b[key], torch.Tensor):
                assert torch.equal(flat_b[key], flat_a[key]), f"{section}.{key} changed by a rejected update"
            else:
                assert flat_b[key] == flat_a[key], f"{section}.{key}"
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


def test_lora_syncs_only_the_adapter_and_learns(tmp_path):
    run = tmp_path / "run"
    _finish(_torchrun(run, "lora.rank=8", "train.lr=0.003", "train.steps=90", "checkpoint.every=0", *EXACT))
    rows = _metrics(run)
    first, last = statistics.mean(r["reward_mean"] for r in rows[:15]), statistics.mean(r["reward_mean"] for r in rows[-30:])
    print(f"LoRA reward: first 15 steps {first:.3f}, last 30 steps {last:.3f}")
    assert last > first + 0.04, f"LoRA reward did not rise: {first:.3f} -> {last:.3f}"
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


def test_drop_in_loop_runs(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "drop_in.py"), "--steps", "3", "--run-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("step ") == 3


def test_fsdp2_trains_checkpoints_and_resumes(tmp_path):
    run = tmp_path / "run"
    common = ["train.parallel=fsdp2", "checkpoint.every=2", *SMALL]
    _finish(_torchrun(run, "train.steps=4", *common))
    out = _finish(_torchrun(run, "train.steps=6", *common, resume=True))
    assert "resumed from" in out and "step 4" in out
    rows = _metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6] and all(r["accepted"] for r in rows)

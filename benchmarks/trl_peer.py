"""The recipe against the tool users would pick instead: TRL's ``GRPOTrainer`` on the same model and workload.

    python benchmarks/trl_peer.py                       # 3 repeats of TRL, recipe sync and recipe max_staleness=1
    python benchmarks/trl_peer.py --steps 4 --repeats 1 # a tiny run (to build and debug, not to measure)

One workload for both: the same model directory (the embedded tiny Qwen2 unless ``--model``), the embedded
arithmetic prompts, 8 prompts x 4 generations = 32 rollouts per step, at most ``--max-new-tokens`` (32) new
tokens, temperature 1 / no top-k / no top-p, the same learning rate (constant, no warm-up), no KL (beta 0).
TRL runs synchronously (generate with HF ``generate``, then train, on one process; ``use_cpu`` without CUDA);
the recipe runs as a user would start it (``torchrun --nproc-per-node 1 recipes/grpo.py``, one local HF
worker) at ``rollout.max_staleness=0`` (synchronous) and ``1`` (one step off-policy).

Each run is a fresh process, launched and timed by this script::

    end-to-end rollouts/s = rollouts trained / (time the last step ended - time the process was launched)
    steady-state rollouts/s = rollouts of steps w+1..N / (end of step N - end of step w)     (w = --warmup 2)

so start-up (imports, model load, worker start) counts against end to end only. TRL's step times come from
a ``TrainerCallback`` (``on_step_end``), the recipe's from its ``metrics.jsonl`` (``time`` of each step).
Ratios are recipe / TRL of the medians over repeats, against TRL's better setting per rate (``trl`` at torch's
default threads or ``trl1`` at one thread, both run). Writes ``results/trl_peer-DATE.json`` (config,
machine, commit, every run's step times and both rates) and prints the table for ``benchmarks/README.md``.
TRL is in the ``bench`` extra (``pip install -e '.[bench]'``); without it the script says so and exits 0.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "grpo.py"
CONFIG = ROOT / "recipes" / "configs" / "tiny_cpu.yaml"
MODES = ("trl", "trl1", "sync", "async1")
"""``trl``: GRPOTrainer as a user runs it (torch's default intra-op threads, one per core); ``trl1``: GRPOTrainer
with one intra-op thread (on a shared 2-core machine its default 2 threads spin against other processes and
collapse to ~10-20 rollouts/s); ``sync``: the recipe at max_staleness=0; ``async1``: at max_staleness=1."""


# ----------------------------------------------------------------------------------------------------------------------
# TRL, in a child process (``--trl-child``)


def trl_child(args: argparse.Namespace) -> None:
    """Trains ``args.steps`` GRPO steps with TRL and writes each step's end time to ``{out}/steps.json``."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from asyncrl.reward_funcs import arithmetic_reward
    from workers.tasks import arithmetic_prompts

    out = Path(args.trl_child)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = arithmetic_prompts(args.num_prompts, seed=0)
    dataset = Dataset.from_list([{"prompt": r["text"], "answer": r["answer"]} for r in rows])

    def reward(completions: list[str], answer: list[str], **_: Any) -> list[float]:
        return [r["reward"] for r in arithmetic_reward(completions, answer)]

    step_end: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *_: Any, **__: Any) -> None:
            step_end.append(time.time())

    config = GRPOConfig(
        output_dir=str(out / "trl"), max_steps=args.steps, learning_rate=args.lr, lr_scheduler_type="constant",
        warmup_steps=0, per_device_train_batch_size=args.prompts_per_step * args.generations,
        num_generations=args.generations, max_completion_length=args.max_new_tokens, temperature=1.0, top_k=0,
        top_p=1.0, beta=0.0, use_cpu=not torch.cuda.is_available(), bf16=False, report_to="none", logging_steps=1,
        save_strategy="no", disable_tqdm=True, seed=0, dataloader_num_workers=0,
    )
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[Clock()])
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    (out / "steps.json").write_text(json.dumps({"step_end": step_end, "reward": rewards}))


# ----------------------------------------------------------------------------------------------------------------------
# the runs


def _env(args: argparse.Namespace) -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    return env


def run_trl(args: argparse.Namespace, run_dir: Path, threads: int | None = None) -> dict[str, Any]:
    run_dir.mkdir(parents=True, exist_ok=True)
    child = argparse.Namespace(**{**vars(args), "threads": threads or args.threads})
    argv = [sys.executable, str(Path(__file__).resolve()), "--trl-child", str(run_dir), *_child_args(child)]
    launched = time.time()
    _run(argv, run_dir / "trl.log", args.timeout, _env(child))
    got = json.loads((run_dir / "steps.json").read_text())
    return {"launched": launched, "step_end": got["step_end"], "reward": got["reward"]}


def recipe_overrides(args: argparse.Namespace, max_staleness: int, run_dir: Path) -> list[str]:
    out = [f"run_dir={run_dir}", f"model.path={args.model_dir}", f"rollout.max_staleness={max_staleness}",
           f"train.steps={args.steps}", f"train.lr={args.lr}", "train.warmup_steps=0", "train.sft_steps=0",
           f"rollout.batch_size={args.prompts_per_step}", f"rollout.group_size={args.generations}",
           f"rollout.worker.engine.max_new_tokens={args.max_new_tokens}", "rollout.worker.engine.temperature=1.0",
           "rollout.worker.engine.top_k=0", "rollout.worker.engine.top_p=1.0", "rollout.num_workers=1",
           f"data.num_prompts={args.num_prompts}", "checkpoint.every=0", "loss.beta=0.0"]
    return out + list(args.set)


def run_recipe(args: argparse.Namespace, max_staleness: int, run_dir: Path) -> dict[str, Any]:
    run_dir.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", str(RECIPE),
            "--config", str(CONFIG), *recipe_overrides(args, max_staleness, run_dir)]
    launched = time.time()
    _run(argv, run_dir / "recipe.log", args.timeout, _env(args), run_dir=run_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"launched": launched, "step_end": [r["time"] for r in rows], "reward": [r["reward_mean"] for r in rows],
            "train_s": [r.get("train_s") for r in rows], "wait_s": [r.get("wait_s") for r in rows],
            "publish_s": [r.get("publish_s") for r in rows]}


def _run(argv: list[str], log: Path, timeout: float, env: dict[str, str], run_dir: Path | None = None) -> None:
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except BaseException:  # a timeout or Ctrl-C: end what we started, by pid
            if run_dir is not None:
                from recipes.grpo import end_run

                end_run(proc, run_dir)
            else:
                proc.kill()
                proc.wait()
            raise
    if rc != 0:
        raise RuntimeError(f"{argv[1:4]} exited {rc}; last output:\n{log.read_text(errors='replace')[-3000:]}")


def rates(run: dict[str, Any], rollouts_per_step: int, warmup: int) -> dict[str, float]:
    """End-to-end and steady-state rollouts/s of one run (see the module docstring)."""
    ends = run["step_end"]
    if len(ends) <= warmup:
        raise ValueError(f"{len(ends)} steps recorded, need more than --warmup={warmup}")
    first_step_s = ends[0] - run["launched"]
    return {
        "end_to_end": rollouts_per_step * len(ends) / (ends[-1] - run["launched"]),
        "steady": rollouts_per_step * (len(ends) - warmup) / (ends[-1] - ends[warmup - 1] if warmup else
                                                              ends[-1] - run["launched"]),
        "first_step_s": first_step_s,
        "wall_s": ends[-1] - run["launched"],
    }


def _child_args(args: argparse.Namespace) -> list[str]:
    return ["--model-dir", str(args.model_dir), "--steps", str(args.steps), "--lr", str(args.lr),
            "--max-new-tokens", str(args.max_new_tokens), "--prompts-per-step", str(args.prompts_per_step),
            "--generations", str(args.generations), "--num-prompts", str(args.num_prompts),
            "--threads", str(args.threads or 0)]


def best_trl(summary: dict[str, dict[str, float]]) -> dict[str, float] | None:
    """Per rate, the better of TRL's runs (``trl``, ``trl1``): the ratios compare with TRL at its best setting."""
    trls = [summary[m] for m in ("trl", "trl1") if m in summary]
    return {k: max(t[k] for t in trls) for k in ("steady", "end_to_end")} if trls else None


def table(summary: dict[str, dict[str, float]]) -> str:
    trl = best_trl(summary)
    lines = [("| run | steady rollouts/s | end-to-end rollouts/s | first step (s) | steady x best TRL | "
              "end-to-end x best TRL |"), "|---|---|---|---|---|---|"]
    for mode, s in summary.items():
        ratios = [f"{s[k] / trl[k]:.2f}x" if trl else "-" for k in ("steady", "end_to_end")]
        lines.append(f"| {mode} | {s['steady']:.1f} | {s['end_to_end']:.1f} | {s['first_step_s']:.2f} | "
                     f"{ratios[0]} | {ratios[1]} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the steady-state rate")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {MODES}")
    p.add_argument("--model", default=None, help="HF model directory (default: the tiny model, built once)")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--generations", type=int, default=4)
    p.add_argument("--num-prompts", type=int, default=1024)
    p.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of every run (default: torch's)")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--workdir", default=None, help="where runs go (default: a fresh temp directory)")
    p.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/trl_peer-DATE.json)")
    p.add_argument("--set", action="append", default=[], help="extra recipe override (key=value), repeatable")
    p.add_argument("--trl-child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.trl_child:
        trl_child(args)
        return 0
    modes = [m for m in args.modes.split(",") if m]
    if unknown := set(modes) - set(MODES):
        p.error(f"unknown --modes {sorted(unknown)}; choose from {MODES}")
    if {"trl", "trl1"} & set(modes) and importlib.util.find_spec("trl") is None:
        print("trl_peer: skipped: trl is not installed (it is in the bench extra: pip install -e '.[bench]')")
        return 0
    import tempfile

    sys.path.insert(0, str(ROOT))
    from benchmarks._report import machine

    work = Path(args.workdir or tempfile.mkdtemp(prefix="trl_peer-"))
    if args.model:
        args.model_dir = str(Path(args.model).resolve())
    else:
        from workers.tiny_model import build_tiny_model

        args.model_dir = str(build_tiny_model(work / "model"))
    per_step = args.prompts_per_step * args.generations
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for repeat in range(args.repeats):  # interleaved, so drift in the machine's load hits every mode alike
        for mode in modes:
            run_dir = work / f"{mode}-{repeat}"
            if mode in ("trl", "trl1"):
                run = run_trl(args, run_dir, threads=1 if mode == "trl1" else None)
            else:
                run = run_recipe(args, 0 if mode == "sync" else 1, run_dir)
            run["rates"] = rates(run, per_step, args.warmup)
            runs[mode].append(run)
            r = run["rates"]
            print(f"{mode} #{repeat}: steady {r['steady']:.1f} rollouts/s, end to end {r['end_to_end']:.1f}, "
                  f"first step {r['first_step_s']:.2f} s", flush=True)
    summary = {m: {k: statistics.median(run["rates"][k] for run in rs) for k in rs[0]["rates"]}
               for m, rs in runs.items()}
    text = table(summary)
    print(text)
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"trl_peer-{time.strftime('%Y-%m-%d')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in vars(args).items() if k not in ("trl_child",)}
    out.write_text(json.dumps({"benchmark": "trl_peer", "time": time.time(), "config": config, "machine": machine(),
                               "rollouts_per_step": per_step, "summary": summary, "runs": runs, "table": text},
                              indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

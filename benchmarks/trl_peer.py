"""The recipe against the tool users would pick instead: TRL's ``GRPOTrainer`` on the same model and workload.

    python benchmarks/trl_peer.py --engine              # 3 repeats of every mode, and the HF engine alone first
    python benchmarks/trl_peer.py --steps 20 --repeats 3 --modes trl,trl1,sync,async1   # the issue's four
    python benchmarks/trl_peer.py --steps 4 --repeats 1 # a tiny run (to build and debug, not to measure)

One workload for both: the same model directory (the embedded tiny Qwen2 unless ``--model``), the embedded
arithmetic prompts, 8 prompts x 4 generations = 32 rollouts per step, at most ``--max-new-tokens`` (32) new
tokens, temperature 1 / no top-k / no top-p, the same learning rate (constant, no warm-up), no KL (beta 0).
TRL runs synchronously (generate with HF ``generate``, then train, on one process; ``use_cpu`` without CUDA);
the recipe runs as a user would start it (``torchrun --nproc-per-node 1 recipes/grpo.py``, local HF workers) at
``rollout.max_staleness=0`` (synchronous) and ``1`` (one step off-policy); see :data:`TRL_MODES` and
:data:`RECIPE_MODES` for every mode's settings.

What is the same and what is not (the fairness of it): both sample their own tokens from their own policies, so
each run records its mean response length (tokens per rollout; the table shows it). Threads: TRL runs one process
(``trl``: torch's default intra-op threads, ``trl1``: one); the recipe's trainer and each worker run one intra-op
thread each (``asyncrl.train.threads``), so the recipe can keep both cores busy where TRL's single process cannot, which
is the point of it at ``max_staleness >= 1``. The prompt is the raw text for TRL and BOS + text for the recipe (one
token). The recipe's step also runs its update guard, weight publish and debugger; TRL its own logging.

Each run is a fresh process, launched and timed by this script::

    end-to-end rollouts/s = rollouts trained / (time the last step ended - time the process was launched)
    steady-state rollouts/s = rollouts of steps w+1..N / (end of step N - end of step w)     (w = --warmup 2)

so start-up (imports, model load, worker start) counts against end to end only. TRL's step times come from
a ``TrainerCallback`` (``on_step_end``), the recipe's from its ``metrics.jsonl`` (``time`` of each step).
Ratios are recipe / TRL of the medians over repeats, against TRL's better synchronous setting per rate (``trl``
or ``trl1``), and per repeat (:func:`paired_ratios`: each run against the same repeat's TRL, minutes apart). The
runs are interleaved (mode by mode within each repeat) and each records the load average at its end. ``--engine``
first times one worker batch of the HF engine alone (:func:`engine_child`). Writes ``results/trl_peer-DATE.json``
(config, machine, commit, every run's step times, response lengths, worker busy fractions and rates) and prints
the table for ``benchmarks/README.md``. TRL is in the ``bench`` extra (``pip install -e '.[bench]'``); without it
the script says so and exits 0.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "grpo.py"
CONFIG = ROOT / "recipes" / "configs" / "tiny_cpu.yaml"
TRL_MODES: dict[str, dict[str, int | None]] = {
    "trl": {"threads": None, "steps_per_generation": 1},
    "trl1": {"threads": 1, "steps_per_generation": 1},
    "trl1_g2": {"threads": 1, "steps_per_generation": 2},
}
"""``trl``: GRPOTrainer as a user runs it (torch's default intra-op threads, one per core); ``trl1``: at one intra-op
thread (on a shared 2-core machine its default 2 threads spin against other processes and collapse to ~10-20
rollouts/s); ``trl1_g2``: one thread, ``steps_per_generation=2`` (TRL's own lever for bigger generation batches: one
``generate`` of 2 steps' prompts, 64 rows, feeds two optimizer steps, the second one a step off-policy: TRL's
counterpart of ``max_staleness=1``, not synchronous, so not in the ratios' baseline)."""
RECIPE_MODES: dict[str, dict[str, Any]] = {
    "sync": {"max_staleness": 0, "workers": 1, "steps_per_batch": 1},
    "async1": {"max_staleness": 1, "workers": 1, "steps_per_batch": 1},
    "async1_b2": {"max_staleness": 1, "workers": 1, "steps_per_batch": 2},
    "async1_w2": {"max_staleness": 1, "workers": 2, "steps_per_batch": 1},
    "sync_t2": {"max_staleness": 0, "workers": 1, "steps_per_batch": 1, "threads": 2,
                "env": {"OMP_WAIT_POLICY": "PASSIVE"}},
    "sync_c": {"max_staleness": 0, "workers": 1, "steps_per_batch": 1,
               "set": ["rollout.worker.engine.compile=true", "rollout.worker.engine.max_num_seqs=32"]},
    "async1_b2_c": {"max_staleness": 1, "workers": 1, "steps_per_batch": 2,
                    "set": ["rollout.worker.engine.compile=true", "rollout.worker.engine.max_num_seqs=64"]},
}
"""The recipe (``torchrun --nproc-per-node 1``): ``sync`` at max_staleness=0 with one local worker; ``async1`` at
max_staleness=1, as it was measured first; ``async1_b2``: one worker whose ``generate`` takes two steps' groups
(``rollout.worker.slots`` = ``max_batch`` = 2 x prompts per step: the in-flight bound at max_staleness=1 is exactly
that, and the tiny model's batch of 64 rows costs ~1.3x one of 32); ``async1_w2``: two local workers of one step's
groups each (the trainer's core is mostly idle at max_staleness=1); ``sync_t2``: ``sync`` with a 2-thread trainer
(``train.threads``: at max_staleness=0 trainer and worker take turns, so the worker's core idles while the trainer
steps) whose OpenMP threads sleep at once after each parallel region (``OMP_WAIT_POLICY=PASSIVE``) instead of spinning
into the worker's turn (without it, at load 4-5, a 2-thread trainer's step took 1.1-1.6 s instead of 0.03-0.04 s;
with it 0.04-0.07 s: each parallel region waited for a thread the kernel had descheduled); ``sync_c`` and
``async1_b2_c``: ``sync`` and ``async1_b2`` with ``engine.compile`` (the HF lean decode's one-token step compiled by
``torch.compile``; ``max_num_seqs`` set so that the worker compiles at start, before its first lease)."""
MODES = (*TRL_MODES, *RECIPE_MODES)
DEFAULT_MODES = ("trl", "trl1", "trl1_g2", "sync", "async1", "async1_b2", "async1_w2")


# ----------------------------------------------------------------------------------------------------------------------
# TRL, in a child process (``--trl-child``)


def trl_child(args: argparse.Namespace) -> None:
    """Trains ``args.steps`` GRPO steps with TRL and writes each step's end time to ``{out}/steps.json``."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from asyncrl.data.tasks import arithmetic_prompts
    from asyncrl.rewards.builtin import arithmetic_reward

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
        steps_per_generation=args.steps_per_generation,
    )
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[Clock()])
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    (out / "steps.json").write_text(json.dumps({
        "step_end": step_end, "reward": [h["reward"] for h in logs],
        "response_len": [h.get("completions/mean_length") for h in logs], "threads": torch.get_num_threads(),
    }))


# ----------------------------------------------------------------------------------------------------------------------
# the HF engine alone, in a child process (``--engine-child``): where a worker batch's time goes


def engine_child(args: argparse.Namespace) -> None:
    """Times one worker batch of the HF engine (``--prompts-per-step`` prompts x ``--generations``, at most
    ``--max-new-tokens``, one intra-op thread): the lean decode loop against ``generate`` on the same rows and seed,
    the lean loop on two steps' prompts at once (``async1_b2``'s batch) and the lean loop with ``engine.compile``
    (compiled before the timed rounds), interleaved; writes
    ``{out}/engine.json``."""
    import torch

    from asyncrl.config import HFEngineConfig
    from asyncrl.data.tasks import arithmetic_prompts
    from workers.engines import build_engine
    from workers.engines._rows import left_pad

    torch.set_num_threads(1)
    out = Path(args.engine_child)
    engine = build_engine(HFEngineConfig(model=args.model_dir, seed=0, max_new_tokens=args.max_new_tokens,
                                       temperature=1.0, top_k=0, top_p=1.0))
    rows = arithmetic_prompts(4 * args.prompts_per_step, seed=0)

    def batch(prompts: int, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = [engine._prompt_ids({"text": rows[(offset + i) % len(rows)]["text"]}) for i in range(prompts)]
        return left_pad([p for p in ids for _ in range(args.generations)], engine.pad_id)

    n = args.prompts_per_step
    paths = {"generate": (engine._sample_generate, n), "lean": (engine._sample_decode, n),
             "lean_2_steps": (engine._sample_decode, 2 * n)}
    # engine.compile: the same model and seed with the one-token step compiled (warmed up for the step's rows)
    compiled = build_engine(HFEngineConfig(model=args.model_dir, seed=0, max_new_tokens=args.max_new_tokens,
                                         temperature=1.0, top_k=0, top_p=1.0, compile=True,
                                         max_num_seqs=n * args.generations))
    paths["lean_compiled"] = (compiled._sample_decode, n)
    times: dict[str, list[float]] = {k: [] for k in paths}
    tokens: dict[str, list[int]] = {k: [] for k in paths}
    for repeat in range(-2, args.steps):  # two warm-up rounds
        for name, (sample, prompts) in paths.items():
            ids, mask = batch(prompts, repeat * n)
            t0 = time.perf_counter()
            seqs, _ = sample(ids, mask, args.max_new_tokens, 1000 + repeat)
            if repeat >= 0:
                times[name].append(time.perf_counter() - t0)
                tokens[name].append(seqs.shape[1] - ids.shape[1])
    (out / "engine.json").write_text(json.dumps({"batch_s": times, "steps": tokens,
                                                 "rows": {k: p * args.generations for k, (_, p) in paths.items()}}))


def run_engine(args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    run_dir.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, str(Path(__file__).resolve()), "--engine-child", str(run_dir), *_child_args(args)]
    _run(argv, run_dir / "engine.log", args.timeout, {**_env(args), "OMP_NUM_THREADS": "1"})
    got = json.loads((run_dir / "engine.json").read_text())
    med = {k: statistics.median(v) for k, v in got["batch_s"].items()}
    got["summary"] = {"batch_s": med, "lean_x_generate": med["generate"] / med["lean"],
                      "compiled_x_lean": med["lean"] / med["lean_compiled"],
                      "rollouts_per_s": {k: got["rows"][k] / v for k, v in med.items()}}
    return got


# ----------------------------------------------------------------------------------------------------------------------
# the runs


def _env(args: argparse.Namespace) -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    return env


def run_trl(args: argparse.Namespace, run_dir: Path, mode: str) -> dict[str, Any]:
    run_dir.mkdir(parents=True, exist_ok=True)
    settings = TRL_MODES[mode]
    child = argparse.Namespace(**{**vars(args), "threads": settings["threads"] or args.threads,
                                  "steps_per_generation": settings["steps_per_generation"]})
    argv = [sys.executable, str(Path(__file__).resolve()), "--trl-child", str(run_dir), *_child_args(child)]
    launched = time.time()
    cpu_s = _run(argv, run_dir / "trl.log", args.timeout, _env(child))
    got = json.loads((run_dir / "steps.json").read_text())
    return {"launched": launched, "exited": time.time(), "cpu_s": cpu_s, **got}


def recipe_overrides(args: argparse.Namespace, mode: str, run_dir: Path) -> list[str]:
    """The recipe's command-line overrides for ``mode`` (:data:`RECIPE_MODES`), then ``--set``'s."""
    settings = RECIPE_MODES[mode]
    slots = settings["steps_per_batch"] * args.prompts_per_step
    out = [f"run_dir={run_dir}", f"model.path={args.model_dir}", f"rollout.max_staleness={settings['max_staleness']}",
           f"train.steps={args.steps}", f"train.lr={args.lr}", "train.warmup_steps=0", "train.sft_steps=0",
           f"rollout.batch_size={args.prompts_per_step}", f"rollout.group_size={args.generations}",
           f"rollout.worker.engine.max_new_tokens={args.max_new_tokens}", "rollout.worker.engine.temperature=1.0",
           "rollout.worker.engine.top_k=0", "rollout.worker.engine.top_p=1.0",
           f"rollout.num_workers={settings['workers']}", f"rollout.worker.slots={slots}",
           f"rollout.worker.max_batch={slots}",
           f"data.num_prompts={args.num_prompts}", "checkpoint.every=0", "loss.beta=0.0"]
    if settings.get("threads"):
        out.append(f"train.threads={settings['threads']}")
    return out + list(settings.get("set", ())) + list(args.set)


def run_recipe(args: argparse.Namespace, mode: str, run_dir: Path) -> dict[str, Any]:
    run_dir.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", str(RECIPE),
            "--config", str(CONFIG), *recipe_overrides(args, mode, run_dir)]
    launched = time.time()
    env = {**_env(args), **RECIPE_MODES[mode].get("env", {})}
    cpu_s = _run(argv, run_dir / "recipe.log", args.timeout, env, run_dir=run_dir)
    exited = time.time()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    per_step = args.prompts_per_step * args.generations
    workers = rows[-1].get("pipeline", {}).get("workers", {})
    return {"launched": launched, "exited": exited, "cpu_s": cpu_s, "step_end": [r["time"] for r in rows],
            "reward": [r["reward_mean"] for r in rows],
            "response_len": [r.get("loss/response_tokens", 0.0) / per_step for r in rows],
            "staleness_mean": [r.get("staleness_mean") for r in rows],
            "train_s": [r.get("train_s") for r in rows], "wait_s": [r.get("wait_s") for r in rows],
            "publish_s": [r.get("publish_s") for r in rows],
            "worker_busy": {w: round(s["busy_s"] / s["uptime_s"], 3) for w, s in workers.items() if s.get("uptime_s")}}


def _run(argv: list[str], log: Path, timeout: float, env: dict[str, str], run_dir: Path | None = None) -> float:
    """Runs ``argv`` to its end; returns the CPU seconds (user + system) it and its waited-for descendants used."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
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
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def rates(run: dict[str, Any], rollouts_per_step: int, warmup: int) -> dict[str, float]:
    """End-to-end and steady-state rollouts/s of one run (see the module docstring), and its steady steps' mean
    response length (tokens per rollout: the two tools sample their own tokens)."""
    ends = run["step_end"]
    if len(ends) <= warmup:
        raise ValueError(f"{len(ends)} steps recorded, need more than --warmup={warmup}")
    first_step_s = ends[0] - run["launched"]
    lengths = [x for x in run.get("response_len", [])[warmup:] if x is not None]
    return {
        "response_len": statistics.fmean(lengths) if lengths else float("nan"),
        "end_to_end": rollouts_per_step * len(ends) / (ends[-1] - run["launched"]),
        "steady": rollouts_per_step * (len(ends) - warmup) / (ends[-1] - ends[warmup - 1] if warmup else
                                                              ends[-1] - run["launched"]),
        "first_step_s": first_step_s,
        # cores the run's processes kept busy on average, launch to exit: under load a run of several processes
        # gets a bigger share of the machine than one of a single process (read the ratios with it)
        "cores_used": run["cpu_s"] / (run["exited"] - run["launched"]) if "cpu_s" in run else float("nan"),
        "wall_s": ends[-1] - run["launched"],
    }


def _child_args(args: argparse.Namespace) -> list[str]:
    return ["--model-dir", str(args.model_dir), "--steps", str(args.steps), "--lr", str(args.lr),
            "--max-new-tokens", str(args.max_new_tokens), "--prompts-per-step", str(args.prompts_per_step),
            "--generations", str(args.generations), "--num-prompts", str(args.num_prompts),
            "--threads", str(args.threads or 0), "--steps-per-generation", str(args.steps_per_generation)]


def best_trl(summary: dict[str, dict[str, float]]) -> dict[str, float] | None:
    """Per rate, the better of TRL's synchronous runs (``trl``, ``trl1``): the ratios compare with synchronous TRL
    at its best setting."""
    trls = [summary[m] for m in ("trl", "trl1") if m in summary]
    return {k: max(t[k] for t in trls) for k in ("steady", "end_to_end")} if trls else None


def paired_ratios(runs: dict[str, list[dict[str, Any]]], key: str = "steady") -> dict[str, list[float]]:
    """Per mode, each repeat's rate over the best synchronous TRL rate *of the same repeat* (runs of one repeat are
    minutes apart, so drift in the machine's load cancels more than in a ratio of medians)."""
    trls = [runs[m] for m in ("trl", "trl1") if m in runs]
    if not trls:
        return {}
    best = [max(rs[i]["rates"][key] for rs in trls) for i in range(min(len(rs) for rs in trls))]
    return {m: [run["rates"][key] / b for run, b in zip(rs, best)] for m, rs in runs.items()}


def table(summary: dict[str, dict[str, float]], paired: dict[str, list[float]] | None = None) -> str:
    trl = best_trl(summary)
    paired = paired or {}
    lines = [("| run | steady rollouts/s | end-to-end rollouts/s | first step (s) | response tokens | cores used | "
              "steady x best TRL | end-to-end x best TRL | steady x TRL per repeat |"),
             "|---|---|---|---|---|---|---|---|---|"]
    for mode, s in summary.items():
        ratios = [f"{s[k] / trl[k]:.2f}x" if trl else "-" for k in ("steady", "end_to_end")]
        lines.append(f"| {mode} | {s['steady']:.1f} | {s['end_to_end']:.1f} | {s['first_step_s']:.2f} | "
                     f"{s['response_len']:.1f} | {s.get('cores_used', float('nan')):.2f} | {ratios[0]} | {ratios[1]} | "
                     f"{' / '.join(f'{x:.2f}' for x in paired.get(mode, [])) or '-'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the steady-state rate")
    p.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"comma-separated, of {MODES}")
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
    p.add_argument("--engine-child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--engine", action="store_true",
                   help="also time the HF engine alone first (lean decode vs generate, one and two steps' rows)")
    p.add_argument("--steps-per-generation", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.trl_child:
        trl_child(args)
        return 0
    if args.engine_child:
        engine_child(args)
        return 0
    modes = [m for m in args.modes.split(",") if m]
    if unknown := set(modes) - set(MODES):
        p.error(f"unknown --modes {sorted(unknown)}; choose from {MODES}")
    if set(TRL_MODES) & set(modes) and importlib.util.find_spec("trl") is None:
        print("trl_peer: skipped: trl is not installed (it is in the bench extra: pip install -e '.[bench]')")
        return 0
    import tempfile

    sys.path.insert(0, str(ROOT))
    from benchmarks._report import machine

    work = Path(args.workdir or tempfile.mkdtemp(prefix="trl_peer-"))
    if args.model:
        args.model_dir = str(Path(args.model).resolve())
    else:
        from asyncrl.testing.tiny_model import build_tiny_model

        args.model_dir = str(build_tiny_model(work / "model"))
    per_step = args.prompts_per_step * args.generations
    engine = None
    if args.engine:
        engine = run_engine(args, work / "engine")
        e = engine["summary"]
        print("engine alone (s per batch): " + ", ".join(f"{k} {v:.3f}" for k, v in e["batch_s"].items())
              + f"; lean x generate {e['lean_x_generate']:.2f}, compiled x lean {e['compiled_x_lean']:.2f}", flush=True)
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for repeat in range(args.repeats):  # interleaved, so drift in the machine's load hits every mode alike
        for mode in modes:
            run_dir = work / f"{mode}-{repeat}"
            run = run_trl(args, run_dir, mode) if mode in TRL_MODES else run_recipe(args, mode, run_dir)
            run["load_avg"] = os.getloadavg()
            run["rates"] = rates(run, per_step, args.warmup)
            runs[mode].append(run)
            r = run["rates"]
            print(f"{mode} #{repeat}: steady {r['steady']:.1f} rollouts/s, end to end {r['end_to_end']:.1f}, "
                  f"first step {r['first_step_s']:.2f} s, {r['response_len']:.1f} tokens/rollout, "
                  f"load {run['load_avg'][0]:.1f}", flush=True)
    summary = {m: {k: statistics.median(run["rates"][k] for run in rs) for k in rs[0]["rates"]}
               for m, rs in runs.items()}
    paired = paired_ratios(runs)
    text = table(summary, paired)
    loads = [run["load_avg"][0] for rs in runs.values() for run in rs]
    text += f"\n\nload average (1 min) at the end of each run: {min(loads):.1f}-{max(loads):.1f}"
    print(text)
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"trl_peer-{time.strftime('%Y-%m-%d')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in vars(args).items() if k not in ("trl_child", "engine_child")}
    out.write_text(json.dumps({"benchmark": "trl_peer", "time": time.time(), "config": config, "machine": machine(),
                               "rollouts_per_step": per_step, "summary": summary, "paired_steady_ratios": paired,
                               "engine": engine,
                               "runs": runs, "table": text},
                              indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

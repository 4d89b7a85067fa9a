"""What a resume at another number of trainer ranks costs, against a resume at the same number (elastic M).

    python -m benchmarks.elastic_resume [--prompts 100000] [--params 4000000] [--buffered 48] [--repeats 3]

A save at M ranks, then resumes at M′, each in its own gloo process group (``torch.multiprocessing`` ranks, a file
store): every rank holds a model (``--params`` parameters in linear layers, one AdamW step, so the optimizer state is
real) and a ``RolloutLoader`` (no workers) whose pool holds ``--buffered`` groups of ``--group-size`` rollouts of
``--response-tokens`` tokens, half of them trained (consumed) and the rest buffered, over a dataset of ``--prompts``
prompts with their token lengths (shards balanced by tokens). ``Checkpointer.save`` writes the checkpoint once per
saved size; each resume then builds the same trainer at M′ and times, per rank, on the same checkpoint:

* ``model_s``: ``Checkpointer.load_model`` (DCP: the model and the optimizer, resharded to M′);
* ``loader_s``: ``Checkpointer.load_loader``: this rank's loader file at M′ = M; at M′ ≠ M every saved rank's file
  (memory-mapped), merged and re-dealt (``asyncrl.pool.reshard``), and applied;
* ``first_batch_s``: the first batch after it, from the groups that were buffered at the save (no generation);
* ``resume_s``: the three together; the slowest rank of the resume counts.

Cases: 1→1 and 2→2 (the baselines), 2→1 and 1→2; ratios are a resized resume over the same-size resume at the same
M′, in the same run (``2->1 / 1->1``, ``1->2 / 2->2``). Each case is one launch of M′ processes that resumes
``--repeats`` + 1 times, a fresh trainer each time (the first resume warms the processes up and is not counted).
Medians over ``--repeats`` resumes (min and max kept), JSON into ``benchmarks/results/`` with config and machine.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks._report import machine

ROOT = Path(__file__).parents[1]
CASES = [(1, 1), (2, 2), (2, 1), (1, 2)]


def _model(params: int) -> torch.nn.Module:
    width = 1024
    layers = max(1, params // (width * width))
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(layers)))


def _trainer(args: argparse.Namespace, rank: int, world: int) -> tuple[Any, Any, Any]:
    from asyncrl import Checkpointer, LoaderConfig, RolloutLoader

    model = _model(args.params)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(2, 1024)).pow(2).mean().backward()
    optimizer.step()
    prompts = [{"prompt_ids": [1, 2]} for _ in range(args.prompts)]
    lengths = [16 + (i * 7919) % 113 for i in range(args.prompts)]
    config = LoaderConfig(group_size=args.group_size, batch_size=2, capacity=4 * args.buffered, num_workers=0,
                          max_staleness=None, wait_timeout_s=60, poll_timeout_s=0.1)
    # one incarnation per start or resume, the same on every rank (the recipe broadcasts rank 0's)
    loader = RolloutLoader(prompts, config, rank=rank, world_size=world, prompt_lengths=lengths,
                           incarnation=args.incarnation)
    return model, optimizer, Checkpointer(Path(args.root) / f"from-{args.saved}", model, optimizer, loader)


def _fill(loader: Any, args: argparse.Namespace) -> None:
    """``--buffered`` groups into the pool as a worker would send them; half of them trained (one batch a step)."""
    from asyncrl.rollout import Rollout

    it = iter(loader)
    g = torch.Generator().manual_seed(loader.rank)
    for lease in loader.pool.grant("bench", args.buffered, now=0.0):
        n = args.response_tokens
        loader.pool.add_rollouts([
            Rollout(epoch=lease.epoch, prompt_index=lease.prompt_index, sample_index=s, worker_id="bench",
                    policy_version=0, prompt_ids=torch.randint(0, 1000, (64,), generator=g, dtype=torch.int32),
                    response_ids=torch.randint(0, 1000, (n,), generator=g, dtype=torch.int32),
                    logprobs=-torch.rand(n, generator=g), reward=float(s % 2))
            for s in range(args.group_size)], lease_id=lease.lease_id)
    for _ in range(args.buffered // 4):  # batches of 2 groups: half the groups trained
        next(it)
        loader.commit()


def _rank(rank: int, world: int, args: argparse.Namespace, mode: str, out: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{args.store}-{mode}-{world}", rank=rank, world_size=world)
    try:
        if mode == "save":
            _, _, ckpt = _trainer(args, rank, world)
            _fill(ckpt.loader, args)
            ckpt.save(1, 0)
            ckpt.loader.close()
            return
        for repeat in range(args.repeats + 1):  # the first resume of a process warms it up (imports, DCP planners)
            _, _, ckpt = _trainer(args, rank, world)
            path = ckpt.resolve()
            dist.barrier()
            t0 = time.perf_counter()
            ckpt.load_model(path)
            t1 = time.perf_counter()
            ckpt.load_loader(path)
            t2 = time.perf_counter()
            batch = next(iter(ckpt.loader))
            t3 = time.perf_counter()
            assert len(batch["group_ids"]) == 2
            if repeat:
                out.put({"rank": rank, "repeat": repeat, "model_s": t1 - t0, "loader_s": t2 - t1,
                         "first_batch_s": t3 - t2, "resume_s": t3 - t0})
            dist.barrier()
            ckpt.loader.close()
    finally:
        dist.destroy_process_group()


def _launch(world: int, args: argparse.Namespace, mode: str) -> list[dict[str, float]]:
    from asyncrl.pool.timeline import new_incarnation

    args.incarnation = new_incarnation()
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.start_processes(_rank, args=(world, args, mode, out), nprocs=world, join=True, start_method="spawn")
    rows = []
    while not out.empty():
        rows.append(out.get())
    return rows


def _summary(values: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "samples": values}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=100_000)
    p.add_argument("--params", type=int, default=4_000_000, help="model parameters (linear layers of 1024 x 1024)")
    p.add_argument("--buffered", type=int, default=48, help="groups in each saved rank's pool (half trained)")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--response-tokens", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/elastic_resume-DATE.json)")
    args = p.parse_args()
    cases: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        args.root, args.store = tmp, os.path.join(tmp, "store")
        for saved in sorted({m for m, _ in CASES}):
            args.saved = saved
            _launch(saved, args, "save")
        for saved, resumed in CASES:
            args.saved = saved
            rows = _launch(resumed, args, f"resume-{saved}")
            for repeat in sorted({r["repeat"] for r in rows}):
                slowest = max((r for r in rows if r["repeat"] == repeat), key=lambda r: r["resume_s"])
                timings = {k: v for k, v in slowest.items() if k not in ("rank", "repeat")}
                case = cases.setdefault(f"{saved}->{resumed}", {k: [] for k in timings})
                for k, v in timings.items():
                    case[k].append(v)
                print(f"{saved} -> {resumed}, resume {repeat}: " + ", ".join(f"{k} {v:.3f}" for k, v in timings.items()),
                      flush=True)
    metrics = {name: {k: _summary(v) for k, v in case.items()} for name, case in cases.items()}
    ratios = {f"{m}->{n} / {n}->{n}": {k: metrics[f"{m}->{n}"][k]["median"] / metrics[f"{n}->{n}"][k]["median"]
                                       for k in ("resume_s", "loader_s")}
              for m, n in CASES if m != n}
    for name, r in ratios.items():
        print(f"{name}: resume {r['resume_s']:.2f}x, loader {r['loader_s']:.2f}x")
    result = {"benchmark": "elastic_resume", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "config": {k: v for k, v in vars(args).items()
                         if k not in ("root", "store", "saved", "out", "incarnation")},
              "machine": machine(), "load_average": os.getloadavg(), "metrics": metrics, "ratios": ratios}
    path = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"elastic_resume-{dt.date.today()}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

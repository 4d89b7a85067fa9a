"""Stage ``checkpoint``: save at N ranks, load at M; model and optimizer bit for bit, RNG and loader restored.

    ranks 1,2 (ctx.ranks in order; each launch is one world size, its tasks run in order on every rank):

    launch x1:  save C1 ─────────────────────── load C1 (x1, full)
    launch x2:  load C1 (1 -> 2, resharded)  ── save C2 ── load C2 (x2, full)
    launch x1:  load C2 (2 -> 1, resharded)

``save``: the library's :class:`~asyncrl.checkpoint.Checkpointer` after one AdamW step (``exp_avg``,
``exp_avg_sq`` and ``step`` non-trivial), with a real :class:`~asyncrl.RolloutLoader` (its pool and ledger; no
workers) at policy version 3 and a rank-specific RNG state. ``load`` at the same world size is
``Checkpointer.load`` (model, optimizer, RNG, loader, step and policy version); at another world size it is
``Checkpointer.load_model`` (DCP reshards the model and the optimizer; RNG and loader state are per rank in the
library, which refuses them at another world size by design, so they are checked at the same world size only).

Compared: every parameter and buffer and every optimizer state tensor by digest of its full bytes (bit for bit,
``checkpoint.max_abs`` = 0), the optimizer's hyperparameters, each rank's RNG state and its loader's state dict
(flattened, path by path), the step and the policy version. A difference names the tensor, the optimizer state
entry (``optim.state.<parameter>.exp_avg``) or the loader path. Blocks on the ranks it launches.
"""

from __future__ import annotations

import time
from typing import Any

from asyncrl.check import CheckContext, StageResult
from asyncrl.check._policy import begin_stage, fixed_batch

__all__ = ["run"]

TIMEOUT_S = 600.0


def plan(ranks: list[int]) -> list[tuple[int, list[dict[str, Any]]]]:
    """``(world size, tasks)`` per launch: each world size saves and reloads its own checkpoint and loads the
    previous one's (resharded); the first world size finally loads the last one's."""
    launches: list[tuple[int, list[dict[str, Any]]]] = []
    for i, n in enumerate(ranks):
        tasks = [] if i == 0 else [_load(ranks[i - 1], n, full=False)]
        tasks += [{"name": f"save{n}", "kind": "save", "source": n}, _load(n, n, full=True)]
        launches.append((n, tasks))
    if len(ranks) > 1 and ranks[-1] != ranks[0]:
        launches.append((ranks[0], [_load(ranks[-1], ranks[0], full=False)]))
    return launches


def _load(source: int, world: int, *, full: bool) -> dict[str, Any]:
    return {"name": f"load{source}to{world}", "kind": "load", "source": source, "full": full}


def _diff(label: str, kind: str, want: dict[str, str], got: dict[str, str]) -> list[dict[str, Any]]:
    out = []
    for key in sorted(set(want) | set(got)):
        if key not in got:
            out.append({"name": key, "what": f"{label}: {kind} missing after resume"})
        elif key not in want:
            out.append({"name": key, "what": f"{label}: {kind} not in the saved checkpoint"})
        elif want[key] != got[key]:
            out.append({"name": key, "what": f"{label}: {kind} differs after resume", "saved": want[key][:80],
                        "loaded": got[key][:80]})
    return out


def compare(task: dict[str, Any], saved: list[dict[str, Any]], loaded: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Offenders of one load against the save it read (rank 0 for the model and optimizer; every rank for the rest)."""
    label = f"{task['source']} -> {loaded[0]['world']} ranks"
    offenders = _diff(label, "parameter", saved[0]["tensors"], loaded[0]["tensors"])
    offenders += _diff(label, "optimizer state", saved[0]["optim"], loaded[0]["optim"])
    if not task["full"]:
        return offenders
    for want, got in zip(saved, loaded):
        r = got["rank"]
        if want["rng"] != got["rng"]:
            offenders.append({"name": f"rng (rank {r})", "what": f"{label}: RNG state not restored"})
        offenders += [{**o, "name": f"loader.{o['name']} (rank {r})"}
                      for o in _diff(label, "loader state", want["loader"], got["loader"])]
        trainer = got.get("trainer", {})
        if trainer.get("step") != 1 or trainer.get("policy_version") != 3:
            offenders.append({"name": f"trainer state (rank {r})", "what": f"{label}: step/policy version not restored",
                              "loaded": trainer})
    return offenders


def _kinds(offenders: list[dict[str, Any]]) -> str:
    """``optimizer state 54, parameter 2``: how many offenders of each kind."""
    counts: dict[str, int] = {}
    for o in offenders:
        what = o["what"].split(": ", 1)[-1]
        kind = next((k for k in ("parameter", "optimizer state", "loader state", "RNG", "step", "rank failed",
                                 "optimizer has no state") if k in what), what)
        counts[kind] = counts.get(kind, 0) + 1
    return ", ".join(f"{k} {n}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def run(ctx: CheckContext) -> StageResult:
    """Saves and loads across ``ctx.ranks`` under ``ctx.parallel`` (see the module docstring)."""
    from transformers import AutoConfig

    from asyncrl.check._ranks import launch_ranks
    from asyncrl.codec import dumps_json, loads_json

    t0 = time.perf_counter()
    work, skipped = begin_stage(ctx, "checkpoint")
    if skipped is not None:
        return skipped
    config = AutoConfig.from_pretrained(ctx.model)
    pad = config.pad_token_id if isinstance(config.pad_token_id, int) else 0
    fixed_batch(int(config.vocab_size), seed=ctx.seed, pad_token_id=pad)  # fails here, not in every rank
    records: dict[str, list[dict[str, Any]]] = {}
    offenders: list[dict[str, Any]] = []
    metrics: dict[str, Any] = {"loads": {}}
    for i, (n, tasks) in enumerate(plan(list(ctx.ranks))):
        for task in tasks:
            task["root"] = str(work / f"ckpt-{task['source']}")
        spec = {"model": ctx.model, "dtype": ctx.dtype, "lora_rank": ctx.lora_rank, "seed": ctx.seed,
                "parallel": ctx.parallel, "imports": list(ctx.imports), "out": str(work), "tasks": tasks,
                "batch": {"vocab_size": int(config.vocab_size), "seed": ctx.seed, "pad_token_id": pad}}
        (work / f"spec-{i}.json").write_bytes(dumps_json(spec))
        results = launch_ranks(["-m", "asyncrl.check._checkpoint_ranks", str(work / f"spec-{i}.json")], n,
                               timeout_s=TIMEOUT_S)
        failed = [r for r in results if r.returncode != 0]
        if failed:
            first = min(failed, key=lambda r: r.returncode == -9)  # the rank that died, not one the launcher ended
            offenders.append({"name": f"{ctx.parallel} x{n}", "what": f"a rank failed during {[t['name'] for t in tasks]}",
                              "error": f"rank {first.rank} exited {first.returncode}: {first.tail(1500)}"})
            break
        for task in tasks:
            records[task["name"]] = [loads_json((work / f"{task['name']}-rank{r}.json").read_bytes()) for r in range(n)]
            if task["kind"] == "save":
                optim = [k for k in records[task["name"]][0]["optim"] if k.startswith("optim.state.")]
                metrics[f"saved_x{n}"] = {"tensors": len(records[task["name"]][0]["tensors"]), "optim_tensors": len(optim)}
                if not optim:
                    offenders.append({"name": f"save x{n}", "what": "the optimizer has no state after a step"})
                continue
            found = compare(task, records[f"save{task['source']}"], records[task["name"]])
            metrics["loads"][task["name"]] = {"full": task["full"], "offenders": len(found)}
            offenders += found
    loads = ", ".join(f"{k.removeprefix('load').replace('to', '->')}" + ("" if v["full"] else " (resharded)")
                      for k, v in metrics["loads"].items())
    saved = next((v for k, v in metrics.items() if k.startswith("saved_")), {})
    summary = (f"{ctx.parallel} {loads}: {saved.get('tensors', 0)} tensors + {saved.get('optim_tensors', 0)} optimizer "
               f"state tensors bit for bit, RNG and loader restored" if not offenders
               else f"{ctx.parallel} {loads}: {len(offenders)} differences after resume ({_kinds(offenders)})")
    return StageResult(stage="checkpoint", ok=not offenders, summary=summary, offenders=offenders[: ctx.worst],
                       metrics=metrics, seconds=time.perf_counter() - t0)

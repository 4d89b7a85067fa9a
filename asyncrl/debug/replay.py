"""``asyncrl replay DUMP [--checkpoint CKPT]``: where, token by token, rollout and trainer disagree.

A dump (``{run_dir}/dumps/step-*.msgpack``, written by the debugger or the update guard) holds a batch
with its provenance: tokens, masks, rollout logprobs and their version stamps, rewards, the trainer
logprobs it was scored with, the detector windows, and the model directory and sampling settings.
Replay recomputes the trainer side from a checkpoint (the weights of the step's policy version) in
this process, on the CPU, without a process group, and separates a *system* bug from an
*algorithmic* instability:

=========================  ===================================================================
cause                      evidence
=========================  ===================================================================
nonfinite_rollout_logprobs NaN/inf in what the rollout side reported (rows, positions, workers)
nonfinite_rewards          NaN/inf rewards
nonfinite_trainer          the trainer forward itself yields NaN/inf (weights or numerics)
rejected_at_gate           rollouts never reached the batch: the pool's validation rejected them
shifted_alignment          rollout logprobs equal the trainer's one position over (mask/position ids)
stale_weights              rows stamped version v equal the weights of another checkpoint u != v
logprob_mismatch           rows disagree and no checkpoint or shift explains it
reward_outlier             logprobs agree; rewards far outside the detector's window
algorithmic                logprobs agree, rewards in range: the update itself was too large
consistent                 nothing wrong found in the batch
=========================  ===================================================================

Rows are compared with the weights of the version they are stamped with (``token_versions``):
the given checkpoint for rows of its version, other checkpoints of the run (``--search``, default the
run's ``checkpoints/``) for the rest and for the stale-weights search. Checkpoints hold the version
they were saved at (``trainer-rank0.pt``).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path
from typing import Any

import orjson
import torch

from asyncrl.debug.dump import read_dump
from asyncrl.train.logprobs import token_logprobs

__all__ = ["main", "replay"]


class _Weights:
    """Trainer-side logprobs of the dumped batch under each checkpoint, computed once per checkpoint."""

    def __init__(self, model_dir: str, batch: dict[str, torch.Tensor], sampling: dict[str, Any],
                 images: list[list[bytes]] | None = None):
        self.model_dir, self.batch, self.sampling = model_dir, batch, sampling
        self.images = images
        """Image prompts: each row's image bytes as dumped; the model's processor re-runs on them."""
        self.cache: dict[Path, torch.Tensor] = {}

    def logprobs(self, checkpoint: Path) -> torch.Tensor:
        if checkpoint not in self.cache:
            from asyncrl.debug.align import load_policy  # full or LoRA recipe checkpoints

            model = load_policy(self.model_dir, str(checkpoint), torch.float32)
            images, suppress = None, []
            if self.images and any(self.images):
                from asyncrl.data.images import processor_inputs, vision_token_ids
                from asyncrl.models.loading import load_processor

                processor = load_processor(self.model_dir)
                images, suppress = processor_inputs(processor, self.images), vision_token_ids(processor)
            self.cache[checkpoint] = token_logprobs(model, self.batch["input_ids"].long(),
                                                    self.batch["attention_mask"], **self.sampling, images=images,
                                                    suppress_token_ids=suppress)
        return self.cache[checkpoint]


def checkpoint_version(checkpoint: Path) -> int | None:
    """The policy version a recipe checkpoint was saved at (None if it does not say)."""
    trainer = sorted(checkpoint.glob("trainer-rank*.pt"))
    return int(torch.load(trainer[0], weights_only=True)["policy_version"]) if trainer else None


def _row_diffs(trainer: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, tol: float) -> list[dict[str, Any]]:
    out = []
    for b in range(mask.shape[0]):
        pos = mask[b].nonzero().flatten()
        d = (trainer[b, pos] - rollout[b, pos]).abs()
        d = torch.where(torch.isfinite(d), d, torch.full_like(d, math.inf))
        bad = (d > tol).nonzero().flatten()
        out.append({"row": b, "max_abs_diff": float(d.max()) if d.numel() else 0.0,
                    "first_mismatch": int(bad[0]) if bad.numel() else None,
                    "first_mismatch_index": int(pos[bad[0]]) if bad.numel() else None})
    return out


def _shift_fit(trainer: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, rows: list[int], tol: float) -> int | None:
    """+1 if rollout[t] == trainer[t-1] on (almost) every masked token of ``rows`` past the first, -1 for
    rollout[t] == trainer[t+1]; None if neither fits."""
    for shift in (1, -1):
        hits = total = 0
        for b in rows:
            pos = mask[b].nonzero().flatten()
            pos = pos[1:] if shift == 1 else pos[:-1]
            if not pos.numel():
                continue
            d = (rollout[b, pos] - trainer[b, pos - shift]).abs()
            hits += int((d <= tol).sum())
            total += int(pos.numel())
        if total and hits >= 0.9 * total:
            return shift
    return None


def replay(dump: str | Path, checkpoint: str | Path | None = None, *, model_dir: str | None = None,
           search: str | Path | None = None, tol: float = 1e-3, worst: int = 5) -> dict[str, Any]:
    """Diagnoses one dump; returns the report (``cause``, ``explanation``, per-row findings, worst tokens)."""
    kind, body = read_dump(dump)
    if kind not in ("anomaly_batch", "rejected_batch"):
        raise ValueError(f"{dump} holds a {kind!r} dump, not a batch")
    b = {k: v.clone() for k, v in body["batch"].items()}
    mask = b["loss_mask"].bool()
    rollout = b["rollout_logprobs"].float()
    version = int(body["policy_version"])
    model_dir = model_dir or body.get("model_dir")
    report: dict[str, Any] = {"dump": str(dump), "step": body["step"], "rank": body["rank"], "policy_version": version,
                              "anomalies": body.get("anomalies", []), "guard_reason": body.get("reason", "")}
    rows_version = [int(b["token_versions"][r][mask[r]].max()) if mask[r].any() else version for r in range(mask.shape[0])]
    workers = body.get("worker_ids") or ["?"] * mask.shape[0]
    uids = body.get("uids") or [str(r) for r in range(mask.shape[0])]

    # the trainer side: recomputed from checkpoints when we have them, else as dumped
    weights = _Weights(model_dir, b, body.get("sampling", {}), body.get("images")) if model_dir else None
    if body.get("image_sha256"):  # provenance of image prompts: which images each row saw
        report["image_sha256"] = body["image_sha256"]
    checkpoints: dict[int, Path] = {}
    search_dir = Path(search) if search else (Path(body["checkpoint_dir"]) if body.get("checkpoint_dir") else None)
    if search_dir is not None and search_dir.is_dir():
        for ckpt in sorted(search_dir.glob("step-*")):
            v = checkpoint_version(ckpt)
            if v is not None:
                checkpoints.setdefault(v, ckpt)
    if checkpoint is not None:
        checkpoint = Path(checkpoint)
        v = checkpoint_version(checkpoint)
        report["checkpoint"] = {"path": str(checkpoint), "version": v}
        if v is not None and v != version:
            report["checkpoint"]["warning"] = f"checkpoint holds version {v}, the batch was consumed at version {version}"
        checkpoints[v if v is not None else version] = checkpoint
    if weights is None or version not in checkpoints:
        if "trainer_logprobs" not in body:
            raise SystemExit(f"{dump}: no trainer logprobs in the dump and no checkpoint of version {version}: "
                             "pass --checkpoint (the run's checkpoints/step-N of that version)")
        trainer = body["trainer_logprobs"].float().clone()
        report["trainer_side"] = "as dumped (no checkpoint of the batch's version)"
    else:
        trainer = weights.logprobs(checkpoints[version])
        report["trainer_side"] = f"recomputed from {checkpoints[version]}"
        if "trainer_logprobs" in body:  # did the checkpoint reproduce what the trainer saw?
            d = (trainer - body["trainer_logprobs"].float())[mask].abs()
            report["checkpoint_reproduces_trainer"] = float(d[torch.isfinite(d)].max()) if d.numel() else 0.0

    # per row: compare with the weights of the version it is stamped with
    rows = _row_diffs(trainer, rollout, mask, tol)
    for r in rows:
        r.update(uid=uids[r["row"]], worker=workers[r["row"]], stamped_version=rows_version[r["row"]])
        if r["stamped_version"] != version and weights is not None and r["stamped_version"] in checkpoints:
            own = weights.logprobs(checkpoints[r["stamped_version"]])
            r.update(_row_diffs(own, rollout, mask, tol)[r["row"]], compared_with=r["stamped_version"])
        elif r["stamped_version"] != version:
            r["compared_with"] = None  # off-policy row, no checkpoint of its version: not judged
        else:
            r["compared_with"] = version
    judged = [r for r in rows if r["compared_with"] is not None]
    bad = [r for r in judged if r["first_mismatch"] is not None]
    report["rows"] = {"total": len(rows), "judged": len(judged), "mismatching": len(bad)}
    report["mismatching_rows"] = bad[:50]
    report["worst_tokens"] = _worst_tokens(trainer, rollout, mask, b["input_ids"], model_dir, worst)
    report.update(_diagnose(body, b, rollout, trainer, mask, bad, rows_version, workers, weights, checkpoints, tol))
    return report


def _diagnose(body, b, rollout, trainer, mask, bad, rows_version, workers, weights, checkpoints, tol) -> dict[str, Any]:
    def where(values: torch.Tensor) -> list[tuple[int, int]]:
        return [(int(r), int(c)) for r, c in (~torch.isfinite(values) & mask).nonzero()[:10]]

    if where(rollout):
        rows = sorted({r for r, _ in where(rollout)})
        return {"cause": "nonfinite_rollout_logprobs", "explanation": (
            f"non-finite rollout logprobs at (row, position) {where(rollout)} from worker(s) "
            f"{sorted({workers[r] for r in rows})}: the engine's numerics, not the trainer")}
    if not torch.isfinite(b["rewards"]).all():
        rows = (~torch.isfinite(b["rewards"])).nonzero().flatten().tolist()
        return {"cause": "nonfinite_rewards", "explanation": f"non-finite rewards in rows {rows[:10]} "
                f"(workers {sorted({workers[r] for r in rows})}): the reward function or environment"}
    if where(trainer):
        return {"cause": "nonfinite_trainer", "explanation": f"the trainer forward gives non-finite logprobs at "
                f"{where(trainer)} with finite inputs: trainer weights or numerics"}
    if bad:
        first = bad[0]
        head = (f"{len(bad)} row(s) disagree with the weights of their stamped version; first: row {first['row']} "
                f"({first['uid']}, worker {first['worker']}, version {first['stamped_version']}) at response "
                f"position {first['first_mismatch']}, |Δ| up to {first['max_abs_diff']:.3g}")
        shift = _shift_fit(trainer, rollout, mask, [r["row"] for r in bad], tol)
        if shift is not None:
            return {"cause": "shifted_alignment", "shift": shift, "first_mismatch": first, "explanation": (
                f"{head}. The rollout logprob of token t equals the trainer's of token t{-shift:+d}: "
                f"logprobs (or the loss mask / position ids) are shifted by {shift:+d} position")}
        if weights is not None:
            matches: dict[str, int] = {}
            for v, ckpt in sorted(checkpoints.items()):
                own = weights.logprobs(ckpt)
                diffs = _row_diffs(own, rollout, mask, tol)
                if all(diffs[r["row"]]["first_mismatch"] is None for r in bad):
                    matches = {"version": v, "checkpoint": str(ckpt)}
                    break
            if matches:
                stamped = sorted({r["stamped_version"] for r in bad})
                return {"cause": "stale_weights", "matched": matches, "first_mismatch": first, "explanation": (
                    f"{head}. These rows match the weights of version {matches['version']} ({matches['checkpoint']}) "
                    f"but are stamped {stamped}: worker(s) {sorted({r['worker'] for r in bad})} generated with stale "
                    f"weights under a newer version stamp (a weight update not applied, or applied to the wrong place)")}
        return {"cause": "logprob_mismatch", "first_mismatch": first, "explanation": (
            f"{head}. No shift and no checkpoint of this run explains it (searched versions "
            f"{sorted(checkpoints)}): check tokenisation, padding and the sampling settings {body.get('sampling')}")}
    gate = body.get("gate") or {}
    if gate.get("bad_messages_delta"):
        errors = [f"{w}: {e}" for w, e in gate.get("recent_errors", [])[-5:]]
        refused = [_refused(r) for r in gate.get("rejected_rollouts", [])]
        return {"cause": "rejected_at_gate", "errors": errors, "refused": refused, "explanation": (
            f"the batch itself is consistent, but the pool rejected {gate['bad_messages_delta']} message(s) "
            f"during this step; most recent: {errors}"
            + ("; refused rollouts as received: " + "; ".join(r["summary"] for r in refused) if refused else ""))}
    hist = body.get("history", {}).get("reward_mean", [])
    rewards = b["rewards"]
    if len(hist) >= 2:
        med = statistics.median(hist)
        spread = max(1.4826 * statistics.median(abs(h - med) for h in hist), 0.05, 0.1 * abs(med))
        z = abs(float(rewards.mean()) - med) / spread
        if z > 8:
            return {"cause": "reward_outlier", "explanation": (
                f"rollout and trainer logprobs agree token by token; the rewards do not: mean "
                f"{float(rewards.mean()):.4g} (max {float(rewards.max()):.4g}) vs the window's median {med:.4g} "
                f"(robust z={z:.0f}): the reward function or environment, not the pipeline")}
    if body.get("reason"):
        return {"cause": "algorithmic", "explanation": (
            f"inputs are consistent (logprobs agree, rewards in range) but the update was rejected: "
            f"{body['reason']}: an algorithmic instability (lr, clipping, advantage scale), not a system bug")}
    return {"cause": "consistent", "explanation": "logprobs agree token by token and rewards are in range"}


def _refused(entry: dict[str, Any]) -> dict[str, Any]:
    """What was wrong with one refused rollout, from its wire dict as the gate received it."""
    d = entry.get("rollout") or {}
    lp = d.get("logprobs")
    lp = torch.as_tensor(lp, dtype=torch.float32) if lp is not None else torch.zeros(0)
    bad = (~torch.isfinite(lp)).nonzero().flatten().tolist()
    out = {"uid": d.get("uid"), "worker": entry.get("worker"), "policy_version": d.get("policy_version"),
           "error": entry.get("error"), "nonfinite_positions": bad[:20], "tokens": int(lp.numel())}
    out["summary"] = (f"{out['uid']} (worker {out['worker']}, version {out['policy_version']}): "
                      + (f"non-finite logprobs at positions {bad[:8]} of {lp.numel()}" if bad else out["error"]))
    return out


def _worst_tokens(trainer, rollout, mask, input_ids, model_dir, k) -> list[dict[str, Any]]:
    d = (trainer - rollout).abs()
    d = torch.where(torch.isfinite(d), d, torch.full_like(d, math.inf))
    d = torch.where(mask, d, torch.full_like(d, -1.0))
    top = d.flatten().topk(min(k, int(mask.sum()))) if mask.any() else None
    if top is None:
        return []
    tokenizer = None
    if model_dir:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    out = []
    for flat in top.indices.tolist():
        r, t = divmod(flat, d.shape[1])
        ids = input_ids[r].tolist()
        text = None
        if tokenizer is not None:
            text = (tokenizer.decode(ids[max(0, t - 12):t]) + "[" + tokenizer.decode(ids[t:t + 1]) + "]"
                    + tokenizer.decode(ids[t + 1:t + 4]))
        out.append({"row": r, "position": t, "token_id": ids[t], "rollout": float(rollout[r, t]),
                    "trainer": float(trainer[r, t]), "abs_diff": float(d[r, t]), "context": text})
    return out


def format_report(report: dict[str, Any]) -> str:
    lines = [f"replay of {report['dump']}: step {report['step']}, rank {report['rank']}, "
             f"batch consumed at policy version {report['policy_version']}"]
    for a in report["anomalies"]:
        lines.append(f"  anomaly {a['kind']}: {a['detail']}")
    lines.append(f"  trainer side: {report['trainer_side']}")
    if "checkpoint_reproduces_trainer" in report:
        lines.append(f"  checkpoint vs the trainer's own logprobs at the time: max |Δ| = "
                     f"{report['checkpoint_reproduces_trainer']:.3g}")
    if report.get("checkpoint", {}).get("warning"):
        lines.append(f"  WARNING: {report['checkpoint']['warning']}")
    rows = report["rows"]
    lines.append(f"  rows: {rows['total']}, judged against their version's weights: {rows['judged']}, "
                 f"mismatching: {rows['mismatching']}")
    if report["mismatching_rows"]:
        lines.append(f"  {'row':>4} {'uid':<16} {'worker':<24} {'version':>7} {'first pos':>9} {'max |Δ|':>10}")
        for r in report["mismatching_rows"][:10]:
            lines.append(f"  {r['row']:>4} {r['uid']:<16} {str(r['worker'])[:24]:<24} {r['stamped_version']:>7} "
                         f"{r['first_mismatch']!s:>9} {r['max_abs_diff']:>10.3g}")
    if report["worst_tokens"]:
        lines.append("  worst tokens (rollout vs trainer logprob):")
        for w in report["worst_tokens"]:
            lines.append(f"    row {w['row']} pos {w['position']}: {w['rollout']:.4f} vs {w['trainer']:.4f} "
                         f"(|Δ| {w['abs_diff']:.3g})  {w['context']!r}")
    lines.append(f"CAUSE: {report['cause']}: {report['explanation']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="asyncrl replay", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dump", help="a dump file (run_dir/dumps/step-*.msgpack)")
    p.add_argument("--checkpoint", help="checkpoint with the weights of the batch's policy version")
    p.add_argument("--model", help="model directory (default: the one recorded in the dump)")
    p.add_argument("--search", help="directory of checkpoints to search (default: the run's checkpoints/)")
    p.add_argument("--tol", type=float, default=1e-3, help="|Δ logprob| counted as a mismatch (fp32: 1e-3)")
    p.add_argument("--worst", type=int, default=5, help="how many worst tokens to show")
    p.add_argument("--json", help="also write the report as JSON here")
    args = p.parse_args(argv)
    report = replay(args.dump, args.checkpoint, model_dir=args.model, search=args.search, tol=args.tol, worst=args.worst)
    print(format_report(report))
    if args.json:
        Path(args.json).write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

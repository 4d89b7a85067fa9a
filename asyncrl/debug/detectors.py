"""Anomaly detectors over the per-step record, and the capture of an offending batch as a dump.

:class:`Debugger` is what a training loop holds: once per step, after its update, the loop calls
:meth:`Debugger.observe`; it builds the step record (:mod:`asyncrl.debug.record`), runs the
detectors on it, and if any fires writes the batch with its full provenance to
``{run_dir}/dumps/step-{step:06d}-rank{r}.msgpack`` (``asyncrl.debug.dump`` format, kind ``anomaly_batch``),
the batch's rollouts as readable samples to ``{run_dir}/samples.jsonl`` (given a :class:`~asyncrl.debug.samples.SampleLog`),
and one line per anomaly to ``{run_dir}/debug/anomalies.jsonl``; the line and the dump name the dump and the samples
(``{"file": "samples.jsonl", "step": s, "rank": r}``). Detectors only observe: they never
change the update (the update guard does that, and its rejections are one of the detectors).

Detectors (``DebugConfig.detectors``), each for a class of bug:

- ``nonfinite``: NaN/inf in rewards, advantages, rollout or trainer logprobs, loss or grad norm.
- ``guard_rejection``: the update guard rejected the step's update.
- ``version_lag``: a rollout more versions behind the trainer than the bound (the loader's
  ``max_staleness`` by default): the pipeline's staleness fence is broken.
- ``logprob_mismatch``: on tokens the rollout says were sampled from the trainer's current version,
  rollout and trainer logprobs differ by more than ``logprob_tol``. Off-policy tokens may differ;
  these may not: a mask or position shift, stale weights under a wrong version stamp, a bad reshard.
- ``logprob_shift``: the p99 of |trainer - rollout logprob| jumps up against the running window
  (robust z-score in decades): catches the same bugs in fully off-policy batches.
- ``reward_shift``: the batch's reward mean or spread jumps against the running window.
- ``ratio_tail``: too many tokens with importance ratio outside [0.5, 2).
- ``rejected_rollouts``: the pool's gate rejected rollouts during this step (bad messages): what a
  worker sent never reached the batch, and the dump carries the gate's reasons.
- ``weight_mismatch``: a worker's post-sync verification (:mod:`asyncrl.weights.verify`) found that its
  engine does not hold what the trainer published (a mis-mapped fused tensor, a skipped LoRA update); the
  detail names the workers and tensors.

Shift detectors compare against the last ``window`` steps on which they did not fire, so a
persisting fault keeps firing instead of becoming the new normal.
"""

from __future__ import annotations

import hashlib
import math
import os
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import torch

from asyncrl.config.debug import DebugConfig
from asyncrl.debug.dump import write_dump
from asyncrl.debug.record import StepRecorder, step_record
from asyncrl.debug.samples import SampleLog
from asyncrl.weights.verify import weight_mismatches

__all__ = ["Anomaly", "AnomalyDetectors", "Debugger", "weights_checksum"]


@dataclass(kw_only=True, slots=True)
class Anomaly:
    kind: str
    detail: str


def _robust_z(value: float, history: deque[float], floor: float) -> float:
    med = statistics.median(history)
    mad = statistics.median(abs(h - med) for h in history)
    return abs(value - med) / max(1.4826 * mad, floor)


class AnomalyDetectors:
    """The detectors with their running windows. :meth:`check` one record per step, in order."""

    def __init__(self, config: DebugConfig, max_staleness: int | None = None):
        self.config = config
        self.bound = config.max_version_lag if config.max_version_lag is not None else max_staleness
        self.history: dict[str, deque[float]] = {}

    def _shift(self, name: str, value: float | None, floor: float, what: str, up_only: bool = False) -> str | None:
        """Compares ``value`` with its window; records it if it is not a shift. Returns the detail or None."""
        if value is None or not math.isfinite(value):
            return None
        hist = self.history.setdefault(name, deque(maxlen=self.config.window))
        if len(hist) >= self.config.min_history:
            z = _robust_z(value, hist, floor)
            if z > self.config.shift_z and (not up_only or value > statistics.median(hist)):
                return f"{what} {value:.4g} vs window median {statistics.median(hist):.4g} (robust z={z:.1f})"
        hist.append(value)
        return None

    def check(self, record: dict[str, Any], transport: dict[str, Any] | None = None) -> list[Anomaly]:
        on = set(self.config.detectors)
        dist = record["dist"]
        out: list[Anomaly] = []
        if "nonfinite" in on:
            bad = {k: dist[k]["nonfinite"] for k in ("reward", "advantage", "rollout_logprob", "trainer_logprob")
                   if dist[k]["nonfinite"]}
            for k in ("loss", "grad_norm"):
                if record[k] is None:
                    bad[k] = 1
            if bad:
                out.append(Anomaly(kind="nonfinite", detail="non-finite values: " + ", ".join(f"{k}×{n}" for k, n in bad.items())))
        if "guard_rejection" in on and not record["accepted"]:
            out.append(Anomaly(kind="guard_rejection", detail=record["guard_reason"]))
        if "version_lag" in on and self.bound is not None and record["version_lag"]["max"] > self.bound:
            out.append(Anomaly(kind="version_lag", detail=f"rollout {record['version_lag']['max']} versions behind "
                                                          f"the trainer > bound {self.bound}"))
        onp = dist["logprob_diff_onpolicy"]
        if "logprob_mismatch" in on and onp["n"]:
            worst = max(abs(onp["min"]), abs(onp["max"]))
            if worst > self.config.logprob_tol:
                out.append(Anomaly(kind="logprob_mismatch", detail=(
                    f"max |trainer - rollout logprob| = {worst:.3g} on {onp['n']} on-policy tokens "
                    f"(tolerance {self.config.logprob_tol:g}); p50 {abs(onp['q']['50']):.3g}")))
        diff = dist["logprob_diff"]
        # Only batches with off-policy tokens feed and face the window: an all on-policy batch's diffs are the
        # engine's numerics (exactly 0 where trainer and engine compute alike, log10 -> -12), which is
        # logprob_mismatch's business; mixed into the window they made its median straddle -12 and the
        # off-policy level, and every later off-policy batch of a healthy async run "shifted".
        if "logprob_shift" in on and diff["n"] > onp["n"]:
            p99 = max(abs(diff["q"]["1"]), abs(diff["q"]["99"]))
            detail = self._shift("logprob_p99", math.log10(p99 + 1e-12), 0.25, "log10 p99 |trainer - rollout logprob|",
                                 up_only=True)  # an all on-policy batch in an async run is not a bug
            if detail:
                out.append(Anomaly(kind="logprob_shift", detail=detail))
        reward = dist["reward"]
        if "reward_shift" in on and reward["n"]:
            for stat in ("mean", "std"):
                hist = self.history.get(f"reward_{stat}")
                floor = max(0.1 * abs(statistics.median(hist)), 0.05) if hist else 0.05
                detail = self._shift(f"reward_{stat}", reward[stat], floor, f"reward {stat}")
                if detail:
                    out.append(Anomaly(kind="reward_shift", detail=detail))
        ratio = dist["importance_ratio"]
        if "ratio_tail" in on and ratio["n"]:
            counts = ratio["hist"]["counts"]
            tail = (counts[0] + counts[-1]) / ratio["n"]
            if tail > self.config.ratio_tail_fraction:
                out.append(Anomaly(kind="ratio_tail", detail=(
                    f"{tail:.1%} of tokens have importance ratio outside [0.5, 2) (limit "
                    f"{self.config.ratio_tail_fraction:.1%}); min {ratio['min']:.3g}, max {ratio['max']:.3g}")))
        if "rejected_rollouts" in on and transport and transport.get("bad_messages_delta", 0) > 0:
            errors = "; ".join(f"{w}: {e}" for w, e in transport.get("recent_errors", [])[-3:])
            out.append(Anomaly(kind="rejected_rollouts", detail=(
                f"the pool rejected {transport['bad_messages_delta']} message(s) during this step: {errors}")))
        if "weight_mismatch" in on and transport and transport.get("weight_mismatch_delta", 0) > 0:
            names = "; ".join(f"{w}: {m['tensors']}" for w, m in transport.get("weight_mismatch", {}).items())
            out.append(Anomaly(kind="weight_mismatch", detail=(
                f"{transport['weight_mismatch_delta']} weight update(s) applied during this step differ from the "
                f"published tensors on the workers: {names}")))
        return out


def weights_checksum(tensors: list[torch.Tensor]) -> str:
    """sha256 of the tensors' bytes in order (FSDP shards: of this rank's shard)."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class Debugger:
    """Per-step record + detectors + capture, for one trainer rank.

    Args:
        run_dir: the run directory (``debug/`` and ``dumps/`` go there).
        rank: this trainer rank.
        config: :class:`DebugConfig`.
        max_staleness: the loader's bound (``version_lag``'s default).
        context: what a replay needs besides the batch, stored in every dump: ``model_dir``,
            ``sampling`` (temperature, top_k, top_p), ``loss`` (the loss config as a dict),
            ``checkpoint_dir``.
        append: a resumed run continues its record.
        samples: where an anomalous batch's rollouts are written as readable samples (None: not written).
    """

    def __init__(self, run_dir: str | os.PathLike, rank: int, config: DebugConfig, *, max_staleness: int | None,
                 context: dict[str, Any], append: bool = False, samples: SampleLog | None = None):
        self.run_dir = Path(run_dir)
        self.samples = samples
        self.rank = rank
        self.config = config
        self.context = context
        self.detectors = AnomalyDetectors(config, max_staleness)
        self.recorder = StepRecorder(run_dir, rank, append=append)
        self.anomalies_path = self.run_dir / "debug" / "anomalies.jsonl"
        if not append and rank == 0:
            self.anomalies_path.unlink(missing_ok=True)
        self.dumps = 0
        self._bad_messages = 0
        self._weight_mismatches = 0

    def observe(
        self,
        *,
        step: int,
        policy_version: int,
        batch: dict[str, Any],
        trainer_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        accepted: bool,
        guard_reason: str,
        loss: float,
        grad_norm: float,
        update_ratio: float,
        rewards: torch.Tensor | None = None,
        weight_bytes: int = 0,
        publish_s: float = 0.0,
        transport: dict[str, Any] | None = None,
        weights: Callable[[], list[torch.Tensor]] | None = None,
    ) -> dict[str, Any]:
        """Records the step, runs the detectors and dumps the batch if any fired; returns the record.

        Args:
            transport: the loader's transport stats (``loader.stats()["transport"]``), for ``rejected_rollouts``;
                with ``"rejected_rollouts": loader.rejected_rollouts()`` the refused rollouts go into the dump.
            weights: returns the parameters the batch was scored with (checksummed only for a dump).
        """
        record = step_record(step=step, rank=self.rank, policy_version=policy_version, batch=batch,
                             trainer_logprobs=trainer_logprobs, advantages=advantages, accepted=accepted,
                             guard_reason=guard_reason, loss=loss, grad_norm=grad_norm, update_ratio=update_ratio,
                             weight_bytes=weight_bytes, publish_s=publish_s, rewards=rewards)
        gate = None
        if transport is not None:
            bad = int(transport.get("bad_messages", 0))
            gate = {"bad_messages_delta": bad - self._bad_messages, "recent_errors": transport.get("recent_errors", []),
                    "rejected_rollouts": transport.get("rejected_rollouts", [])}
            self._bad_messages = bad
            record["bad_messages"] = gate["bad_messages_delta"]
            mismatch = weight_mismatches(transport.get("workers") or {})
            gate["weight_mismatch_delta"] = mismatch["count"] - self._weight_mismatches
            gate["weight_mismatch"] = mismatch["workers"]
            self._weight_mismatches = mismatch["count"]
        anomalies = self.detectors.check(record, gate)
        dump = samples = None
        if anomalies and self.dumps < self.config.max_dumps:
            if self.samples is not None:  # the bad batch as text, before the dump that points to it
                self.samples.write(step, batch, trainer_version=policy_version, why="anomaly", rewards=rewards,
                                   advantages=advantages, accepted=accepted)
                samples = self.samples.ref(step)
            dump = self._capture(record, anomalies, batch, trainer_logprobs, advantages, rewards, gate, weights,
                                 loss, grad_norm, update_ratio, guard_reason, samples)
            self.dumps += 1
        record["anomalies"] = [{"kind": a.kind, "detail": a.detail, "dump": dump, "samples": samples}
                               for a in anomalies]
        self.recorder.write(record)
        for a in record["anomalies"]:
            line = {"step": step, "rank": self.rank, "time": record["time"], **a}
            with open(self.anomalies_path, "ab") as f:  # O_APPEND: one write per line, ranks may share the file
                f.write(orjson.dumps(line) + b"\n")
        return record

    def _capture(self, record, anomalies, batch, trainer_logprobs, advantages, rewards, gate, weights, loss,
                 grad_norm, update_ratio, guard_reason, samples) -> str:
        tensors = {k: v.detach().cpu() for k, v in batch.items() if isinstance(v, torch.Tensor)}
        if rewards is not None:
            tensors["rewards"] = rewards.detach().cpu()
        body = {
            "step": record["step"],
            "rank": self.rank,
            "policy_version": record["policy_version"],
            "anomalies": [{"kind": a.kind, "detail": a.detail} for a in anomalies],
            "reason": guard_reason,
            "accepted": record["accepted"],
            "loss": float(loss),
            "grad_norm": float(grad_norm),
            "update_ratio": float(update_ratio),
            "batch": tensors,
            "trainer_logprobs": trainer_logprobs.detach().float().cpu(),
            "advantages": advantages.detach().float().cpu(),
            "reward_components": {k: v.detach().cpu() for k, v in batch.get("reward_components", {}).items()},
            "finish_reasons": list(batch.get("finish_reasons", [])),
            "uids": list(batch["uids"]),
            "group_ids": list(batch["group_ids"]),
            "worker_ids": list(batch["worker_ids"]),
            **{k: batch[k] for k in ("images", "image_sha256") if k in batch},  # image prompts: bytes + hashes
            "weights": {"version": record["policy_version"],
                        "sha256": weights_checksum(weights()) if weights is not None else None},
            "gate": gate,
            "samples": samples,  # where the batch's rollouts are as text (samples.jsonl), or None
            "record": {k: v for k, v in record.items() if k not in ("uids", "anomalies")},
            "history": {k: list(v) for k, v in self.detectors.history.items()},
            **self.context,
        }
        name = f"step-{record['step']:06d}-rank{self.rank}.msgpack"
        write_dump(self.run_dir / "dumps" / name, "anomaly_batch", body)
        return f"dumps/{name}"

    def close(self) -> None:
        self.recorder.close()

"""Sample rollouts a person can read: ``run_dir/samples.jsonl``, one JSON line per rollout.

A training loop holds one :class:`SampleLog` per rank and calls :meth:`SampleLog.write` after a step's update with
the collated batch (``datapipes.collate.collate_groups``) when :meth:`SampleLog.due` says so (every
``debug.samples_every`` steps, the first and the last); the debugger calls it too, with the whole batch, when one of
its detectors fires, and names the rows in its anomaly line and dump (:meth:`SampleLog.ref`). Each line is one
rollout::

    {"step": 10, "rank": 0, "why": "every", "uid": "e0-p17-s3", "group_id": "e0-p17", "worker_id": "w0",
     "prompt": "3+4=", "completion": "7", "reward": 1.0, "rewards": {"arithmetic": 1.0}, "advantage": 0.93,
     "rollout_logprob": -0.41, "rollout_logprob_mean": -0.21, "response_tokens": 2, "finish_reason": "stop",
     "policy_version": 9, "trainer_version": 10, "staleness": 1, "accepted": true}

Prompt and completion are the row's token ids decoded with the run's tokenizer (special tokens left out, as TRL
logs them); ``rollout_logprob`` is the sum of the engine's logprobs of the generated tokens. The ranks of a run share
the file: each step's rows of one rank go in one ``write`` on an ``O_APPEND`` descriptor, so ranks never interleave
within a step. A resumed run rewinds the file to its step with the other records
(:func:`asyncrl.checkpoint.run_dir.record_files`). Nothing blocks but the write.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import orjson
import torch

from asyncrl.debug._jsonl import read_jsonl

__all__ = ["SAMPLES_FILE", "SampleLog", "read_samples", "sample_rows", "table_columns"]

SAMPLES_FILE = "samples.jsonl"


def _num(value: float) -> float | None:
    """JSON has no NaN: a non-finite number is written as null."""
    value = float(value)
    return value if math.isfinite(value) else None


def sample_rows(batch: dict[str, Any], decode: Callable[[list[int]], str], *, step: int, rank: int,
                trainer_version: int, rows: Sequence[int], why: str, rewards: torch.Tensor | None = None,
                advantages: torch.Tensor | None = None, accepted: bool | None = None) -> list[dict[str, Any]]:
    """The sample lines of ``rows`` of a collated batch (pure: no I/O).

    Args:
        decode: token ids -> text (the run's tokenizer's ``decode``).
        trainer_version: the trainer's version when it consumed the batch (staleness is measured from it).
        rows: which rows of the batch.
        why: ``"every"`` (periodic) or ``"anomaly"``.
        rewards: the rewards trained on, if they differ from ``batch["rewards"]``; ``advantages``: ``[B]``.
        accepted: the update guard's verdict on the step that trained the batch.
    """
    ids, prompt_len = batch["input_ids"], batch["prompt_lengths"].tolist()
    response_len = batch["response_lengths"].tolist()
    rewards = batch["rewards"] if rewards is None else rewards
    mask, logprobs = batch["loss_mask"], batch["rollout_logprobs"]
    components = batch.get("reward_components", {})
    out = []
    for i in rows:
        p, n = prompt_len[i], response_len[i]
        generated = logprobs[i][mask[i]].double()
        version = int(batch["policy_versions"][i])
        out.append({
            "step": step, "rank": rank, "why": why, "uid": batch["uids"][i],
            "group_id": batch["group_ids"][int(batch["group_index"][i])], "worker_id": batch["worker_ids"][i],
            "prompt": decode(ids[i, :p].tolist()), "completion": decode(ids[i, p:p + n].tolist()),
            "reward": _num(rewards[i]), "rewards": {k: _num(v[i]) for k, v in components.items()},
            "advantage": None if advantages is None else _num(advantages[i]),
            "rollout_logprob": _num(generated.sum()),
            "rollout_logprob_mean": _num(generated.mean()) if generated.numel() else None,
            "response_tokens": n, "finish_reason": batch["finish_reasons"][i],
            "policy_version": version, "trainer_version": trainer_version, "staleness": trainer_version - version,
            "accepted": accepted,
        })
    return out


def table_columns(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    """Sample lines as one flat table (a tracker's): the columns, then one list of cells per row; each reward
    component is a column ``reward/<name>``."""
    names = sorted({k for r in rows for k in r.get("rewards", {})})
    columns = ["step", "rank", "uid", "prompt", "completion", "reward", *(f"reward/{k}" for k in names), "advantage",
               "rollout_logprob", "response_tokens", "finish_reason", "policy_version", "staleness", "accepted"]
    data = [[r.get("rewards", {}).get(c.removeprefix("reward/")) if c.startswith("reward/") else r.get(c)
             for c in columns] for r in rows]
    return columns, data


def read_samples(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The lines of a ``samples.jsonl`` (a half-written last line, of a live run, is left out)."""
    return read_jsonl(path)


class SampleLog:
    """Appends one rank's sample rollouts to ``{run_dir}/samples.jsonl``.

    Args:
        run_dir: the run directory.
        rank: this trainer rank.
        decode: token ids -> text (the run's tokenizer).
        every: periodic samples every this many steps; 0: none.
        per_step: rows per periodic sample (the batch's first rows: whole groups first).
        last_step: the run's last step (sampled too); None: unknown.
        append: continue an existing file (a resumed run); else rank 0 starts it over.
    """

    def __init__(self, run_dir: str | os.PathLike, rank: int, decode: Callable[[list[int]], str], *, every: int,
                 per_step: int, last_step: int | None = None, append: bool = False):
        self.path = Path(run_dir) / SAMPLES_FILE
        self.rank, self.decode, self.every, self.per_step, self.last_step = rank, decode, every, per_step, last_step
        if not append and rank == 0:
            self.path.unlink(missing_ok=True)
        self.rows: list[dict[str, Any]] = []
        """The rows of the last write (a tracker's table)."""
        self._last = 0  # the last step written (steps come in order; each is written at most once)

    def due(self, step: int) -> bool:
        """Whether ``step`` is a periodic sample step."""
        return self.every > 0 and (step == 1 or step % self.every == 0 or step == self.last_step)

    def ref(self, step: int) -> dict[str, Any]:
        """Where the rows of ``step`` on this rank are: ``{"file": "samples.jsonl", "step": s, "rank": r}``."""
        return {"file": SAMPLES_FILE, "step": step, "rank": self.rank}

    def write(self, step: int, batch: dict[str, Any], *, trainer_version: int, why: str = "every",
              rewards: torch.Tensor | None = None, advantages: torch.Tensor | None = None,
              accepted: bool | None = None) -> list[dict[str, Any]]:
        """Appends the step's rows (``per_step`` of them periodically, every row for an anomaly) and returns them; a
        step written already is not written again (its rows are returned: an anomaly's, when the debugger came
        first)."""
        if step <= self._last:
            return self.rows if step == self._last else []
        n = len(batch["uids"])
        rows = range(n) if why == "anomaly" else range(min(self.per_step, n))
        self.rows = sample_rows(batch, self.decode, step=step, rank=self.rank, trainer_version=trainer_version,
                                rows=rows, why=why, rewards=rewards, advantages=advantages, accepted=accepted)
        data = memoryview(b"".join(orjson.dumps(r) + b"\n" for r in self.rows))
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:  # one write: the ranks' steps never interleave (O_APPEND positions each write at the end); a regular
            while data:  # file takes it whole but for a full disk, where the loop writes the rest
                data = data[os.write(fd, data):]
        finally:
            os.close(fd)
        self._last = step
        return self.rows

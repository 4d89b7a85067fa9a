"""A synthetic run directory in the exact layout ``recipes/grpo.py`` and the debugger write, for report tests.

``make_run`` writes ``metrics.jsonl``, ``config.json`` and, unless ``debug=False``, ``debug/steps-rank{r}.jsonl``,
``debug/anomalies.jsonl``, the ``dumps/*.msgpack`` the anomalies name and ``samples.jsonl`` (every 10 steps and each
anomaly's batch, with a completion that tries to break out of its table cell: :data:`HOSTILE`). ``parse_page`` reads a report page
(as written, or as a browser dumped it) back into its sections.
"""

from __future__ import annotations

import dataclasses
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import numpy as np
import orjson

LOGPROB_DIFF_EDGES = [-1, -1e-1, -1e-2, -1e-3, -1e-4, -1e-5, -1e-6, 0, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1]
IMPORTANCE_RATIO_EDGES = [0.5, 0.8, 0.9, 0.95, 0.99, 0.999, 1.001, 1.01, 1.05, 1.1, 1.25, 2.0]
QUANTILES = ("1", "5", "25", "50", "75", "95", "99")
WORKERS = ("worker-a", "worker-b")
REJECTED_STEP = 17
SAMPLE_EVERY = 10
HOSTILE = "7</td></tr><script>alert('completion')</script>"
"""A completion that would end its cell and run a script if the report did not escape it."""
LONG_PROMPT = "Solve step by step. " * 20 + "What is 3+4?"
"""A prompt longer than the table's preview: folded behind its start."""
ANOMALIES = (  # (step, rank, kind, dump name or None)
    (9, 0, "logprob_spike", "step-000009-rank0.msgpack"),
    (23, 1, "reward_collapse", "step-000023-rank1.msgpack"),
)


def summary(values: np.ndarray, edges: list[float] | None = None) -> dict[str, Any]:
    """The debugger's Summary of ``values``; per-step edges (9 quantile points) unless ``edges`` is given."""
    finite = values[np.isfinite(values)]
    if finite.size == 0:
        nulls = dict.fromkeys(("mean", "std", "min", "max"))
        return {"n": 0, "nonfinite": int(values.size), **nulls, "q": dict.fromkeys(QUANTILES),
                "hist": {"edges": edges or [], "counts": [0] * (len(edges or []) + 1)}}
    edges = edges if edges is not None else np.unique(np.quantile(finite, np.linspace(0, 1, 9))).tolist()
    counts = np.bincount(np.searchsorted(edges, finite, side="right"), minlength=len(edges) + 1)
    return {
        "n": int(finite.size), "nonfinite": int(values.size - finite.size),
        "mean": float(finite.mean()), "std": float(finite.std()),
        "min": float(finite.min()), "max": float(finite.max()),
        "q": {q: float(np.quantile(finite, int(q) / 100)) for q in QUANTILES},
        "hist": {"edges": edges, "counts": counts.tolist()},
    }


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))


def _lag_hist(lag: np.ndarray) -> list[int]:
    return np.bincount(np.clip(lag, 0, 16), minlength=17).tolist()


def _record(step: int, rank: int, t: float, rng: np.random.Generator, row: dict[str, Any]) -> dict[str, Any]:
    rewards = rng.binomial(1, min(0.9, 0.2 + step / 60), 64).astype(float)
    diff = rng.normal(0, 1e-3 * (10 if step == 9 else 1), 400)
    lag = rng.integers(0, 3, 64)
    anomalies = [{"kind": kind, "detail": f"synthetic {kind} <at> step {step}", "dump": f"dumps/{name}"}
                 for s, r, kind, name in ANOMALIES if (s, r) == (step, rank)]
    return {
        "step": step, "rank": rank, "time": t, "policy_version": row["policy_version"], "accepted": row["accepted"],
        "guard_reason": row["guard_reason"], "loss": row["loss"], "grad_norm": row["grad_norm"],
        "update_ratio": row["update_ratio"],
        "dist": {
            "reward": summary(rewards), "advantage": summary(rewards - rewards.mean()),
            "response_length": summary(rng.integers(4, 64, 64).astype(float)),
            "rollout_logprob": summary(-rng.exponential(1.0, 400)),
            "trainer_logprob": summary(-rng.exponential(1.0, 400)),
            "logprob_diff": summary(diff, LOGPROB_DIFF_EDGES),
            "importance_ratio": summary(np.exp(diff), IMPORTANCE_RATIO_EDGES),
            "generate_s": summary(rng.uniform(0.1, 0.5, 64)),
        },
        "version_lag": {"hist": _lag_hist(lag), "mean": float(lag.mean()), "max": float(lag.max())},
        "workers": {w: {"rollouts": 32, "tokens": 900, "generate_s_mean": 0.3} for w in WORKERS},
        "weight_sync": {"bytes": row["weight_bytes"], "publish_s": row["publish_s"]},
        "uids": [f"0-{step}-{i}" for i in range(4)],
        "anomalies": anomalies,
    }


def _metrics_row(step: int, t: float, rng: np.random.Generator) -> dict[str, Any]:
    rejected = step == REJECTED_STEP
    lag = rng.integers(0, 3, 64)
    step_s, wait_s = 0.5 + rng.uniform(0, 0.2), rng.uniform(0, 0.2)
    return {
        "step": step, "time": t, "policy_version": step - (step > REJECTED_STEP), "accepted": not rejected,
        "guard_reason": "update_ratio=0.31 > guard.max_update_ratio=0.05" if rejected else "",
        "loss": float(rng.normal(0, 0.02)), "grad_norm": float(rng.uniform(1, 5)),
        "update_ratio": 0.31 if rejected else float(rng.uniform(0.001, 0.02)),
        "reward_mean": min(0.9, 0.2 + step / 60) + float(rng.normal(0, 0.03)),
        "staleness_mean": float(lag.mean()), "staleness_max": float(lag.max()), "staleness_hist": _lag_hist(lag),
        "tokens": 1800.0, "weight_bytes": 0 if rejected else 362752, "publish_s": 0.0 if rejected else 0.01,
        "train_s": 0.3, "step_s": step_s, "wait_s": wait_s, "rollouts_per_s": 128 / step_s,
        "loss/pg_loss": float(rng.normal(0, 0.02)), "mismatch/abs_diff_mean": 8e-4, "mismatch/abs_diff_max": 4e-3,
        "pipeline": {
            "stale_dropped": step // 10, "regenerated": step // 10, "rollouts_received": 128 * step, "bad_messages": 0,
            "workers": {w: {"busy_s": (0.4 + 0.3 * i) * step, "uptime_s": 0.7 * step + 1, "weight_apply_s": 0.01 * step,
                            "rollouts_sent": 64 * step, "tokens_generated": 900 * step, "policy_version": step - 1}
                        for i, w in enumerate(WORKERS)},
        },
    }


def make_run(run_dir: Path, *, steps: int = 40, ranks: int = 2, debug: bool = True, seed: int = 0) -> Path:
    """Writes a run of ``steps`` steps (one rejected, two anomalies with dumps, two workers) into ``run_dir``."""
    rng = np.random.default_rng(seed)
    run_dir.mkdir(parents=True, exist_ok=True)
    config = {"run_dir": str(run_dir), "train": {"steps": steps, "lr": 1e-3, "parallel": "ddp"},
              "guard": {"max_update_ratio": 0.05}, "lora": {"rank": 0},
              "rollout": {"max_staleness": 2, "group_size": 8, "batch_size": 8, "num_workers": len(WORKERS),
                          "worker": {"engine": {"type": "hf"}}}}
    (run_dir / "config.json").write_bytes(orjson.dumps(config))
    times = 1.7e9 + np.cumsum(rng.uniform(0.5, 0.7, steps))
    metrics = [_metrics_row(s, float(t), rng) for s, t in zip(range(1, steps + 1), times)]
    _write_jsonl(run_dir / "metrics.jsonl", metrics)
    if not debug:
        return run_dir
    for rank in range(ranks):
        _write_jsonl(run_dir / "debug" / f"steps-rank{rank}.jsonl",
                     [_record(row["step"], rank, row["time"], rng, row) for row in metrics])
    _write_jsonl(run_dir / "debug" / "anomalies.jsonl", [
        {"step": s, "rank": r, "kind": kind, "detail": f"synthetic {kind} <at> step {s}", "dump": f"dumps/{name}",
         "samples": {"file": "samples.jsonl", "step": s, "rank": r}, "time": float(times[s - 1])}
        for s, r, kind, name in ANOMALIES])
    _write_jsonl(run_dir / "samples.jsonl", _samples(steps, ranks, rng))
    (run_dir / "dumps").mkdir(exist_ok=True)
    for *_, name in ANOMALIES:
        (run_dir / "dumps" / name).write_bytes(b"\x82\xa4kind\xa7anomaly")
    return run_dir


def _samples(steps: int, ranks: int, rng: np.random.Generator) -> list[dict[str, Any]]:
    """Sample lines as ``asyncrl.debug.samples`` writes them: 4 rows per rank every ``SAMPLE_EVERY`` steps (and the
    first), 8 per anomaly's batch (one with a long prompt, one with :data:`HOSTILE`)."""
    anomalous = {(s, r) for s, r, *_ in ANOMALIES}
    blocks = sorted({(s, r) for s in range(1, steps + 1) for r in range(ranks) if s == 1 or s % SAMPLE_EVERY == 0}
                    | anomalous)
    out = []
    for step, rank in blocks:
        why = "anomaly" if (step, rank) in anomalous else "every"
        for i in range(8 if why == "anomaly" else 4):
            reward = float(rng.integers(0, 2))
            out.append({
                "step": step, "rank": rank, "why": why, "uid": f"e0-p{step * 10 + rank}-s{i}",
                "group_id": f"e0-p{step * 10 + rank}", "worker_id": WORKERS[rank % 2],
                "prompt": LONG_PROMPT if i == 1 else "3+4=", "completion": HOSTILE if i == 0 and why == "anomaly" else "7",
                "reward": reward, "rewards": {"exact": reward, "format": 1.0}, "advantage": reward - 0.5,
                "rollout_logprob": -1.5, "rollout_logprob_mean": -0.75, "response_tokens": 2, "finish_reason": "stop",
                "policy_version": step - 1, "trainer_version": step, "staleness": 1, "accepted": step != REJECTED_STEP,
            })
    return out


@dataclasses.dataclass
class Section:
    h2: str = ""
    text: str = ""
    images: list[str] = dataclasses.field(default_factory=list)
    links: list[str] = dataclasses.field(default_factory=list)


class _PageParser(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.sections: dict[str, Section] = {}
        self.urls: list[str] = []
        self._current: Section | None = None
        self._in_h2 = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attr = dict(attrs)
        self.urls += [v for k, v in attrs if k in ("src", "href") and v]
        if tag == "section":
            self._current = self.sections[attr["id"]] = Section()
        elif self._current is not None:
            self._in_h2 = tag == "h2"
            if tag == "img":
                self._current.images.append(attr["src"])
            elif tag == "a":
                self._current.links.append(attr["href"])

    def handle_endtag(self, tag: str) -> None:
        self._in_h2 = False
        if tag == "section":
            self._current = None

    def handle_data(self, data: str) -> None:
        if self._current is not None:
            self._current.text += data
            if self._in_h2:
                self._current.h2 += data


def parse_page(page: str) -> tuple[dict[str, Section], list[str]]:
    """The page's sections by id, and every src/href on it."""
    parser = _PageParser()
    parser.feed(page)
    return parser.sections, parser.urls

"""``report.png``: a run's reward and staleness over steps, drawn from its ``metrics.jsonl`` (rank 0, at the end)."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["plot"]


def plot(run_dir: Path) -> None:
    """``report.png``: reward and staleness over steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    if not rows:
        return
    steps = [r["step"] for r in rows]
    fig, (a, b) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    a.plot(steps, [r["reward_mean"] for r in rows], label="reward (mean)")
    a.set_ylabel("reward")
    a.legend()
    b.plot(steps, [r["staleness_mean"] for r in rows], label="staleness (mean)")
    b.plot(steps, [r["staleness_max"] for r in rows], label="staleness (max)", alpha=0.6)
    b.set_xlabel("step")
    b.set_ylabel("policy versions")
    b.legend()
    fig.tight_layout()
    fig.savefig(run_dir / "report.png", dpi=100)
    plt.close(fig)

"""Reading a run's JSONL records (``metrics.jsonl``, ``samples.jsonl``, ``debug/anomalies.jsonl``) while the run may
still be writing them: the report, the end-of-run summary and the samples reader share it. No torch import."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import orjson

__all__ = ["last_per_step", "read_jsonl"]


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The lines of a run's JSONL record (``metrics.jsonl``, ``samples.jsonl``, ...), tolerating a half-written last
    line (a live run may be writing it); ``[]`` when the file does not exist.

    Raises:
        ValueError: a line other than the last is not JSON, naming the file and the line.
    """
    path = Path(path)
    lines = path.read_bytes().splitlines() if path.is_file() else []
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(orjson.loads(line))
        except orjson.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}:{i + 1} is not a JSON line: {line[:80]!r}") from None
    return rows


def last_per_step(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per step, the last written (a resumed run re-logs the steps after its checkpoint), by step."""
    by_step = {r.get("step", i): r for i, r in enumerate(rows)}
    return [by_step[s] for s in sorted(by_step)]

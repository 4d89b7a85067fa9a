"""asyncrl.checkpoint.run_dir: one run per directory (flock, refusal naming the holder, released by SIGKILL) and
record files continued from the resumed step (atomic truncation)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from asyncrl.checkpoint.run_dir import RunDirLock, RunDirLocked, truncate_records


def test_second_holder_is_refused_with_a_sentence_naming_the_first(tmp_path):
    first = RunDirLock(tmp_path / "run")
    first.acquire(["torchrun", "recipes/grpo.py", "--resume"])
    with pytest.raises(RunDirLocked) as e:
        RunDirLock(tmp_path / "run").acquire()  # another open file description: flock conflicts in-process too
    assert f"pid {os.getpid()}" in str(e.value) and "torchrun recipes/grpo.py --resume" in str(e.value)
    first.release()
    second = RunDirLock(tmp_path / "run")
    second.acquire()
    assert second.held and second.holder()["pid"] == os.getpid()
    second.release()


def _write(path: Path, steps: list[int], torn: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    body = b"".join(json.dumps({"step": s, "x": i}).encode() + b"\n" for i, s in enumerate(steps))
    path.write_bytes(body + (b'{"step": 9, "x' if torn else b""))


def test_truncate_keeps_steps_up_to_the_resumed_one_and_drops_a_torn_line(tmp_path):
    path = tmp_path / "debug" / "anomalies.jsonl"
    _write(path, [1, 2, 2, 3, 4, 5, 4], torn=True)  # two ranks' lines interleaved, then a torn write
    inode = path.stat().st_ino
    assert truncate_records(path, 3) == (4, 4)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 2, 3]
    assert path.stat().st_ino != inode  # replaced, not rewritten in place (a kill leaves old or new, whole)
    assert not list(tmp_path.glob("debug/.*.tmp"))
    assert truncate_records(path, 3) == (4, 0)  # idempotent; nothing dropped, file untouched
    assert truncate_records(tmp_path / "missing.jsonl", 3) == (0, 0)


def test_truncate_refuses_a_file_that_is_not_a_record_file(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"step": 1}\n{"no_step": 2}\n')
    with pytest.raises(ValueError, match="integer 'step'"):
        truncate_records(path, 5)

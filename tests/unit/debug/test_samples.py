"""Sample rollouts (asyncrl.debug.samples): what a row says about a collated batch, when a step is sampled, ranks
sharing one file, the debugger writing an anomaly's batch and naming it, and the file rewound on resume."""

from __future__ import annotations

import math
import threading

import orjson
import pytest
import torch

from asyncrl.checkpoint.run_dir import continue_records, record_files
from asyncrl.config import DebugConfig
from asyncrl.debug.detectors import Debugger
from asyncrl.debug.dump import read_dump
from asyncrl.debug.samples import SampleLog, read_samples, sample_rows, table_columns
from asyncrl.rollout import Group, Rollout
from datapipes.collate import collate_groups

VOCAB = {1: "3", 2: "+", 3: "4", 4: "=", 5: "7", 6: "<eos>"}


def decode(ids: list[int]) -> str:
    return "".join(VOCAB[i] for i in ids if i != 6)  # the special token left out, as skip_special_tokens does


def _batch(version: int = 2) -> dict:
    groups = []
    for p in range(2):
        rollouts = [Rollout(epoch=0, prompt_index=p, sample_index=s, worker_id="w0", policy_version=version - s % 2,
                            prompt_ids=torch.tensor([1, 2, 3, 4][: 4 - p], dtype=torch.int32),
                            response_ids=torch.tensor([5, 6][: 1 + s % 2], dtype=torch.int32),
                            logprobs=torch.tensor([-0.5, -0.25][: 1 + s % 2]), reward=float(s % 2),
                            reward_components={"exact": float(s % 2), "format": float("nan") if s == 3 else 1.0})
                    for s in range(4)]
        groups.append(Group(epoch=0, prompt_index=p, rollouts=rollouts))
    return collate_groups(groups)


def test_rows_decode_prompt_and_completion_apart_and_say_where_each_rollout_came_from():
    batch = _batch()
    rows = sample_rows(batch, decode, step=7, rank=1, trainer_version=3, rows=range(8), why="every",
                       advantages=torch.arange(8.0), accepted=False)
    assert [r["prompt"] for r in rows] == ["3+4="] * 4 + ["3+4"] * 4  # each row's own prompt length (padding apart)
    assert [r["completion"] for r in rows[:2]] == ["7", "7"] and rows[1]["response_tokens"] == 2
    assert rows[0]["rollout_logprob"] == -0.5 and rows[1]["rollout_logprob"] == -0.75  # generated tokens only
    assert rows[1]["rollout_logprob_mean"] == -0.375
    assert [r["staleness"] for r in rows[:2]] == [1, 2] and rows[1]["policy_version"] == 1
    assert rows[3]["rewards"] == {"exact": 1.0, "format": None}  # NaN (not scored) is null in JSON
    assert rows[5]["uid"] == "e0-p1-s1" and rows[5]["group_id"] == "e0-p1" and rows[5]["advantage"] == 5.0
    assert all(r["accepted"] is False and r["step"] == 7 and r["rank"] == 1 for r in rows)
    columns, data = table_columns(rows)
    assert columns[:5] == ["step", "rank", "uid", "prompt", "completion"] and "reward/format" in columns
    assert data[3][columns.index("reward/format")] is None and len(data) == 8


def test_periodic_steps_and_one_write_per_step(tmp_path):
    log = SampleLog(tmp_path, 0, decode, every=10, per_step=3, last_step=25)
    assert [s for s in range(1, 26) if log.due(s)] == [1, 10, 20, 25]
    assert not any(SampleLog(tmp_path, 0, decode, every=0, per_step=3).due(s) for s in range(1, 30))
    batch = _batch()
    first = log.write(10, batch, trainer_version=3, why="anomaly")  # the debugger's: the whole batch
    assert len(first) == 8 and log.write(10, batch, trainer_version=3) == first  # not written twice
    assert len(log.write(20, batch, trainer_version=3)) == 3  # periodic: the first rows (whole groups first)
    assert [r["step"] for r in read_samples(tmp_path / "samples.jsonl")] == [10] * 8 + [20] * 3


def test_ranks_share_the_file_without_interleaving_a_step(tmp_path):
    batch = _batch()
    logs = [SampleLog(tmp_path, rank, decode, every=1, per_step=8, append=True) for rank in range(4)]

    def write(log: SampleLog) -> None:
        for step in range(1, 61):
            log.write(step, batch, trainer_version=3)

    threads = [threading.Thread(target=write, args=(log,)) for log in logs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rows = read_samples(tmp_path / "samples.jsonl")
    assert len(rows) == 4 * 60 * 8
    runs = [(rows[i]["step"], rows[i]["rank"]) for i in range(0, len(rows), 8)]
    assert sorted(runs) == sorted((s, r) for s in range(1, 61) for r in range(4))
    assert all(len({(r["step"], r["rank"]) for r in rows[i:i + 8]}) == 1 for i in range(0, len(rows), 8))


def test_a_fresh_run_starts_the_file_over_and_a_resume_rewinds_it(tmp_path):
    (tmp_path / "samples.jsonl").write_bytes(orjson.dumps({"step": 99, "rank": 0}) + b"\n")
    SampleLog(tmp_path, 1, decode, every=1, per_step=1)  # only rank 0 starts it over
    assert (tmp_path / "samples.jsonl").exists()
    log = SampleLog(tmp_path, 0, decode, every=1, per_step=2)
    assert not (tmp_path / "samples.jsonl").exists()
    for step in range(1, 6):
        log.write(step, _batch(), trainer_version=3)
    assert tmp_path / "samples.jsonl" in record_files(tmp_path, 0)
    continue_records(record_files(tmp_path, 0), 3)  # resumed from step 3: steps 4 and 5 are redone
    assert [r["step"] for r in read_samples(tmp_path / "samples.jsonl")] == [1, 1, 2, 2, 3, 3]


def test_the_debugger_writes_an_anomalys_batch_and_points_to_it(tmp_path):
    samples = SampleLog(tmp_path, 0, decode, every=100, per_step=2)
    debugger = Debugger(tmp_path, 0, DebugConfig(), max_staleness=4, context={}, samples=samples)
    batch = _batch()
    rewards = torch.full((8,), math.nan)  # non-finite rewards: the nonfinite detector fires
    record = debugger.observe(step=4, policy_version=3, batch=batch, trainer_logprobs=batch["rollout_logprobs"],
                              advantages=torch.zeros(8), accepted=False, guard_reason="non-finite loss=nan",
                              loss=float("nan"), grad_norm=float("nan"), update_ratio=float("nan"), rewards=rewards)
    assert record["anomalies"] and all(a["samples"] == {"file": "samples.jsonl", "step": 4, "rank": 0}
                                       for a in record["anomalies"])
    line = orjson.loads((tmp_path / "debug" / "anomalies.jsonl").read_bytes().splitlines()[0])
    assert line["samples"] == {"file": "samples.jsonl", "step": 4, "rank": 0}
    _, body = read_dump(tmp_path / line["dump"])
    assert body["samples"] == line["samples"]
    rows = read_samples(tmp_path / "samples.jsonl")
    assert len(rows) == 8 and {r["why"] for r in rows} == {"anomaly"} and sorted(r["uid"] for r in rows) == sorted(
        body["uids"])
    assert all(r["reward"] is None and r["accepted"] is False for r in rows)  # the rewards trained on (NaN)
    debugger.close()


def test_sample_settings_are_checked():
    with pytest.raises(ValueError, match="debug.samples_every=-1"):
        DebugConfig(samples_every=-1)
    with pytest.raises(ValueError, match="samples_per_step=0"):
        DebugConfig(samples_per_step=0)

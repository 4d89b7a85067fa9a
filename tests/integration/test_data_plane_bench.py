"""Smoke test of the Ray-actor queue baseline of ``benchmarks/data_plane.py`` (skipped without Ray)."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks import data_plane as dp

pytestmark = pytest.mark.integration


def test_ray_actor_queue_delivers_collated_batches() -> None:
    pytest.importorskip("ray")
    args = dp.parse_args(["--workers", "1", "--seconds", "1", "--repeats", "1", "--batch-size", "2",
                          "--capacity", "4", "--prompts", "1000", "--paths", "ray_actor"])
    with dp.ray_actor_queue(args, "objects") as (next_batch, info):
        uids: list[str] = []
        for _ in range(3):
            batch = next_batch()
            rows = args.batch_size * dp.GROUP_SIZE
            assert batch["input_ids"].shape == (rows, dp.PROMPT_TOKENS + dp.RESPONSE_TOKENS)
            assert batch["rollout_logprobs"].shape == batch["input_ids"].shape
            assert int(batch["loss_mask"].sum()) == rows * dp.RESPONSE_TOKENS
            assert batch[dp.PAYLOAD_BYTES_KEY] == rows * 8448
            uids += batch["uids"]
        assert len(set(uids)) == len(uids)  # every rollout delivered once

        def step() -> tuple[int, int]:
            b = next_batch()
            return len(b["uids"]), b[dp.PAYLOAD_BYTES_KEY]

        result = dp.measure(step, args, "ray_actor", info["producer_pids"], other_pids=info["other_pids"])
        pids = info["producer_pids"] + [p for ps in info["other_pids"].values() for p in ps]
    assert result["rollouts_per_s"]["median"] > 0
    assert "other:queue_actor" in result["cpu_s"]
    assert info["groups_put"] is not None and info["groups_put"] >= 3 * args.batch_size  # producers stopped cleanly
    assert info["leftover_pids"] == []
    assert not [p for p in pids if dp.pid_alive(p)]  # ray.shutdown() took every Ray process with it


def test_ray_path_without_ray_is_recorded_as_skipped(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # ``import ray`` raises ImportError
    out = tmp_path / "dp.json"
    dp.main(["--paths", "ray_actor", "--consumer-threads", "0", "--out", str(out)])  # 0: leaves torch threads alone
    report = json.loads(out.read_text())
    assert "ray is not importable" in report["metrics"]["ray_actor"]["skipped"]
    assert report["ratios"] == {}

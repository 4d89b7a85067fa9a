"""The simulated freshness benchmark: one synchronous and one asynchronous point on a fast time model.

Both points run the real pipeline (2 fake-engine worker processes, shm weight sync) for a few steps in a
generation-dominated regime, where overlapping generation with training must cut the trainer's waiting.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from benchmarks.freshness_sim import MAX_LAG_BIN, SimConfig, loader_capacity, run_point

pytestmark = pytest.mark.integration

STEPS = 6
SCHEMA = {"step", "time", "policy_version", "accepted", "loss", "reward_mean", "staleness_mean", "staleness_max",
          "staleness_hist", "tokens", "weight_bytes", "publish_s", "train_s", "step_s", "wait_s", "rollouts_per_s",
          "pipeline", "modelled", "time_scale"}
PIPELINE = {"stale_dropped", "regenerated", "rollouts_received", "bad_messages", "workers"}
WORKER = {"busy_s", "uptime_s", "weight_apply_s", "rollouts_sent", "tokens_generated", "policy_version"}

# a 2-lease engine call of ~100-token rows takes ~0.25 s; a trainer step ~0.03 s: generation dominates
SIM = SimConfig(tokens_per_s_per_worker=400.0, train_s_per_token=1e-6, train_s_fixed=0.02, sync_s_per_byte=1e-9,
                weight_bytes=10_000_000, load_s_per_byte=1e-9, length_median=64, length_tail=0.5, min_new_tokens=16,
                max_new_tokens=128, prompt_tokens=16, group_size=4, batch_size=4, max_batch=2, slots=4)


@pytest.fixture(scope="module")
def points(tmp_path_factory) -> dict[int, tuple[Path, list[dict]]]:
    """``max_staleness -> (run_dir, metrics.jsonl rows)`` of the points 0 and 2."""
    out = {}
    for k in (0, 2):
        run_dir = tmp_path_factory.mktemp(f"k{k}")
        t0 = time.monotonic()
        path = run_point(SIM, max_staleness=k, num_workers=2, steps=STEPS, run_dir=run_dir)
        assert time.monotonic() - t0 < 60, "a tiny point must finish within a minute"
        out[k] = run_dir, [json.loads(line) for line in path.read_text().splitlines()]
    return out


@pytest.mark.parametrize("k", [0, 2])
def test_metrics_schema_and_staleness_bound(points, k):
    _, rows = points[k]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        assert set(r) == SCHEMA
        assert set(r["pipeline"]) == PIPELINE
        assert set(r["modelled"]) == {"train_s", "publish_s", "time_scale"}
        assert len(r["staleness_hist"]) == MAX_LAG_BIN + 1
        assert sum(r["staleness_hist"]) == SIM.batch_size * SIM.group_size
        assert r["staleness_max"] <= k
        assert r["accepted"] is True and r["weight_bytes"] == SIM.weight_bytes
        assert r["modelled"]["publish_s"] == pytest.approx(0.01)
        assert r["publish_s"] >= 0.01 and r["train_s"] >= 0.02
        assert r["wait_s"] <= r["step_s"]
    assert [r["policy_version"] for r in rows] == list(range(1, STEPS + 1))


@pytest.mark.parametrize("k", [0, 2])
def test_workers_really_apply_weights(points, k):
    workers = points[k][1][-1]["pipeline"]["workers"]
    assert len(workers) == 2
    for stats in workers.values():
        assert WORKER <= set(stats)
        # adopted from a real shm update: after its first one the fake engine no longer follows the pool
        assert stats["policy_version"] > 0
        assert stats["weight_apply_s"] >= 0.01  # the modelled load: 1e-9 s/byte x 10 MB per version


def test_async_waits_less_than_sync_when_generation_dominates(points):
    (_, sync), (_, asynchronous) = points[0], points[2]
    sync_wait = sum(r["wait_s"] for r in sync)
    async_wait = sum(r["wait_s"] for r in asynchronous)
    assert async_wait < sync_wait, f"{async_wait=:.2f} s >= {sync_wait=:.2f} s"
    # leases only go out for groups that can still be trained fresh: nothing is generated to be dropped
    assert sync[-1]["pipeline"]["stale_dropped"] == 0 and asynchronous[-1]["pipeline"]["stale_dropped"] == 0


def test_run_dir_describes_the_point(points):
    config = json.loads((points[2][0] / "config.json").read_text())
    assert config["point"] == {"max_staleness": 2, "num_workers": 2, "steps": STEPS}
    assert config["derived"]["capacity"] == loader_capacity(SIM, max_staleness=2, num_workers=2)
    assert not Path(config["loader"]["worker"]["weights"]["address"]).exists()  # the shm directory is gone


def test_from_measured_maps_summary_keys():
    # the aggregate tokens/s is not the per-sequence decode speed the time model takes
    summary = {"gen_tokens_per_s_per_worker": 3200, "decode_tokens_per_s_per_sequence": 50, "train_s_per_token": 1e-4, "publish_s_per_byte": 2e-10,
               "apply_s_per_byte": 1e-10, "weight_bytes": 14e9, "length_median": 300.0, "batch_size": 16,
               "train_s_fixed": None}
    sim = SimConfig.from_measured(summary, time_scale=30)
    assert (sim.tokens_per_s_per_worker, sim.sync_s_per_byte, sim.load_s_per_byte) == (50.0, 2e-10, 1e-10)
    assert (sim.weight_bytes, sim.length_median, sim.batch_size, sim.time_scale) == (14_000_000_000, 300, 16, 30)
    assert sim.train_s_fixed == 0.0 and sim.group_size == 4
    with pytest.raises(ValueError, match="tokens_per_s_per_worker"):
        SimConfig.from_measured({"train_s_per_token": 1e-4})


def test_a_streaming_point_reports_occupancy_and_its_in_flight_pauses(tmp_path):
    import dataclasses

    from benchmarks.freshness import analyze

    sim = dataclasses.replace(SIM, streaming=True, streaming_slots=6)
    assert sim.worker_slots() == 6 and sim.engine_width() == SIM.max_batch * SIM.group_size
    path = run_point(sim, max_staleness=2, num_workers=2, steps=STEPS, run_dir=tmp_path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["loader"]["worker"]["streaming"] is True and config["loader"]["worker"]["slots"] == 6
    assert config["loader"]["worker"]["engine"]["max_num_seqs"] == SIM.max_batch * SIM.group_size
    for r in rows:
        assert r["staleness_max"] <= 2 and sum(r["staleness_hist"]) == SIM.batch_size * SIM.group_size
    workers = rows[-1]["pipeline"]["workers"]
    for stats in workers.values():
        assert 0 < stats["busy_seq_s"] <= stats["capacity_seq_s"]
    # updates land while requests are in flight; each pause is at least the modelled load (10 MB x 1e-9 s/byte)
    paused = [s for s in workers.values() if s.get("inflight_updates", 0) > 0]
    assert paused and all(s["inflight_pause_p50_s"] >= 0.01 for s in paused)
    m = analyze(rows, warmup=1, group_size=SIM.group_size)
    assert 0 < m["occupancy"] <= 1 and m["inflight_pause_p99_s"] >= 0.01

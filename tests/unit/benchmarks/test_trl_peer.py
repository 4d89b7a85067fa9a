"""benchmarks/trl_peer.py's arithmetic and its skip without trl (the runs themselves are the benchmark)."""

import importlib.util

import pytest

from benchmarks import trl_peer


def test_rates_from_launch_and_step_ends():
    run = {"launched": 100.0, "step_end": [110.0, 111.0, 112.0, 113.0]}
    got = trl_peer.rates({**run, "cpu_s": 30.0, "exited": 115.0}, 32, warmup=2)
    assert got["end_to_end"] == 32 * 4 / 13 and got["steady"] == 32 * 2 / 2 and got["cores_used"] == 2.0
    assert got["first_step_s"] == 10.0 and got["wall_s"] == 13.0
    with pytest.raises(ValueError, match="need more than --warmup=4"):
        trl_peer.rates(run, 32, warmup=4)


def test_without_trl_it_says_why_and_exits_0(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "trl" else real(name, *a))
    assert trl_peer.main(["--modes", "trl,sync"]) == 0
    assert "skipped: trl is not installed" in capsys.readouterr().out


def test_unknown_modes_are_refused():
    with pytest.raises(SystemExit):
        trl_peer.main(["--modes", "trl,fast"])


def test_ratios_use_trl_at_its_better_thread_setting_per_rate():
    from benchmarks.trl_peer import best_trl, table

    summary = {"trl": {"steady": 20.0, "end_to_end": 30.0, "first_step_s": 9.0, "response_len": 28.0},
               "trl1": {"steady": 200.0, "end_to_end": 25.0, "first_step_s": 10.0, "response_len": 28.0},
               "trl1_g2": {"steady": 400.0, "end_to_end": 50.0, "first_step_s": 10.0, "response_len": 28.0},
               "sync": {"steady": 220.0, "end_to_end": 27.0, "first_step_s": 8.0, "response_len": 27.5}}
    assert best_trl(summary) == {"steady": 200.0, "end_to_end": 30.0}  # synchronous TRL only: not trl1_g2
    summary["sync"]["cores_used"] = 1.5
    row = "| sync | 220.0 | 27.0 | 8.00 | 27.5 | 1.50 | 1.10x | 0.90x | 1.05 / 2.00 |"
    assert row in table(summary, {"sync": [1.05, 2.0]})
    assert best_trl({"sync": summary["sync"]}) is None


def test_paired_ratios_divide_by_the_same_repeats_best_synchronous_trl():
    def run(steady):
        return {"rates": {"steady": steady}}

    runs = {"trl": [run(10.0), run(300.0)], "trl1": [run(100.0), run(200.0)], "trl1_g2": [run(999.0), run(999.0)],
            "async1": [run(150.0), run(330.0)]}
    assert trl_peer.paired_ratios(runs)["async1"] == [1.5, 1.1]
    assert trl_peer.paired_ratios({"async1": runs["async1"]}) == {}


def test_recipe_modes_are_config_overrides():
    from argparse import Namespace
    from pathlib import Path

    args = Namespace(model_dir="m", steps=5, lr=5e-4, prompts_per_step=8, generations=4, max_new_tokens=32,
                     num_prompts=64, set=["train.seed=3"])
    got = {m: trl_peer.recipe_overrides(args, m, Path("r")) for m in trl_peer.RECIPE_MODES}
    assert {"rollout.max_staleness=0", "rollout.num_workers=1", "rollout.worker.max_batch=8"} <= set(got["sync"])
    # one worker generating both in-flight steps' groups in one call; or two workers of one step's groups each
    b2 = {"rollout.max_staleness=1", "rollout.worker.slots=16", "rollout.worker.max_batch=16"}
    assert b2 <= set(got["async1_b2"])
    assert {"rollout.max_staleness=1", "rollout.num_workers=2", "rollout.worker.slots=8"} <= set(got["async1_w2"])
    assert set(got["sync_t2"]) - set(got["sync"]) == {"train.threads=2"}  # and OMP_WAIT_POLICY=PASSIVE in its env
    assert not any(o.startswith("train.threads") for m, o2 in got.items() if m != "sync_t2" for o in o2)
    assert all(o[-1] == "train.seed=3" for o in got.values())  # --set comes last: it wins


def test_rates_report_the_steady_steps_response_length():
    run = {"launched": 0.0, "step_end": [1.0, 2.0, 3.0, 4.0], "response_len": [31.0, 30.0, 20.0, None]}
    assert trl_peer.rates(run, 32, warmup=2)["response_len"] == 20.0

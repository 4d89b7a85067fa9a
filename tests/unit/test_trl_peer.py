"""benchmarks/trl_peer.py's arithmetic and its skip without trl (the runs themselves are the benchmark)."""

import importlib.util

import pytest

from benchmarks import trl_peer


def test_rates_from_launch_and_step_ends():
    run = {"launched": 100.0, "step_end": [110.0, 111.0, 112.0, 113.0]}
    got = trl_peer.rates(run, 32, warmup=2)
    assert got["end_to_end"] == 32 * 4 / 13 and got["steady"] == 32 * 2 / 2
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

    summary = {"trl": {"steady": 20.0, "end_to_end": 30.0, "first_step_s": 9.0},
               "trl1": {"steady": 200.0, "end_to_end": 25.0, "first_step_s": 10.0},
               "sync": {"steady": 220.0, "end_to_end": 27.0, "first_step_s": 8.0}}
    assert best_trl(summary) == {"steady": 200.0, "end_to_end": 30.0}
    assert "| sync | 220.0 | 27.0 | 8.00 | 1.10x | 0.90x |" in table(summary)
    assert best_trl({"sync": summary["sync"]}) is None

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

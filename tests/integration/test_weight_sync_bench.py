"""The weight-sync benchmark runs end to end at a tiny size and writes what the README table is made of."""

from __future__ import annotations

import json

import pytest

from benchmarks import weight_sync

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_quick_run_writes_verified_ratios(tmp_path):
    out = tmp_path / "ws.json"
    weight_sync.main(["--sizes", "0.01", "--receivers", "1", "--repeats", "1", "--out", str(out)])
    report = json.loads(out.read_text())
    (row,) = report["results"].values()
    assert row["memcpy"]["gb_per_s"]["median"] > 0
    for name in ("raw_zmq x1", "shm x1", "shm-shadow x1", "shm-views x1", "zmq x1"):
        assert row[name]["verified"], name  # every receiver's engine tensors matched the payload's xxh3
        assert row[name]["x_memcpy"] > 0 and all(r["failures"] == 0 for r in row[name]["receiver_reports"])
    assert row["shm x1"]["x_raw_zmq"] > 0 and row["zmq x1"]["x_raw_zmq"] > 0
    assert row["shm-shadow x1"]["via_shadow"] == 1  # the timed version went through the engine's shadow
    assert report["skipped"] == [] and report["machine"]["cpu_count"] >= 1


def test_a_case_over_the_memory_budget_is_skipped_or_runs_from_views(tmp_path):
    out = tmp_path / "ws.json"
    weight_sync.main(["--sizes", "0.01", "--receivers", "2", "--repeats", "1", "--backends", "shm,zmq",
                      "--mem-budget-gb", "0.035", "--out", str(out)])
    report = json.loads(out.read_text())
    (row,) = report["results"].values()
    assert "shm-views x2" in row and "shm x2" not in row  # payload + 2 slots fit, + 2 engine copies do not
    assert {(s["path"], s.get("engine", "copy")) for s in report["skipped"]} == {
        ("raw_zmq", "copy"), ("zmq", "copy"), ("shm", "copy"), ("shm", "shadow")}

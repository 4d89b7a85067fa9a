"""Tests for asyncrl.debug.report: the page's sections, embedded figures, dump links and missing inputs."""

from __future__ import annotations

import base64
from pathlib import Path
from urllib.parse import unquote

import orjson
import pytest

from asyncrl.debug.report import main, write_report
from tests._synthetic_run import ANOMALIES, REJECTED_STEP, make_run, parse_page

SECTION_IDS = ("summary", "curves", "staleness", "logprobs", "guard", "anomalies", "throughput")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def full(tmp_path_factory) -> tuple[Path, Path]:
    """A 40-step run with the debugger's records (two ranks), and its report."""
    run = make_run(tmp_path_factory.mktemp("run") / "full")
    return run, write_report(run)


def _old_metrics_only_run(run_dir: Path) -> Path:
    """A run without debug/ whose metrics lack the keys older trainers did not log."""
    make_run(run_dir, steps=12, debug=False)
    old_keys = ("staleness_hist", "wait_s", "pipeline", "publish_s", "time")
    rows = [orjson.loads(line) for line in (run_dir / "metrics.jsonl").read_bytes().splitlines()]
    rows = [{k: v for k, v in r.items() if k not in old_keys} for r in rows]
    (run_dir / "metrics.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    (run_dir / "config.json").unlink()
    return run_dir


def test_page_has_every_section_with_its_heading(full):
    run, page = full
    assert page == run / "report" / "index.html"
    sections, _ = parse_page(page.read_text())
    assert tuple(sections) == SECTION_IDS
    assert all(s.h2.strip() for s in sections.values())
    assert "Missing" not in "".join(s.text for s in sections.values())


def test_figures_are_embedded_and_written_as_files(full):
    run, page = full
    sections, _ = parse_page(page.read_text())
    images = [src for s in sections.values() for src in s.images]
    assert images and all(src.startswith("data:image/png;base64,") for src in images)
    embedded = {base64.b64decode(src.partition(",")[2]) for src in images}
    assert all(png.startswith(PNG_MAGIC) for png in embedded)
    assert embedded == {p.read_bytes() for p in page.parent.glob("*.png")}
    for sid in ("curves", "staleness", "logprobs", "throughput"):
        assert sections[sid].images, f"section {sid} has no figure"
    assert page.stat().st_size < 3_000_000


def test_page_is_self_contained_and_escaped(full):
    _, page = full
    text = page.read_text()
    _, urls = parse_page(text)
    assert all(u.startswith(("data:", "#", "../dumps/")) for u in urls), urls
    assert "<script" not in text and "http://" not in text and "https://" not in text
    assert "synthetic logprob_spike &lt;at&gt; step 9" in text and "<at>" not in text


def test_anomaly_links_resolve_to_the_dumps(full):
    run, page = full
    sections, _ = parse_page(page.read_text())
    targets = [(page.parent / unquote(href)).resolve() for href in sections["anomalies"].links]
    assert targets == [(run / "dumps" / name).resolve() for *_, name in ANOMALIES]
    assert all(t.is_file() for t in targets)


def test_summary_guard_and_workers(full):
    _, page = full
    sections, _ = parse_page(page.read_text())
    summary = sections["summary"].text
    assert "rollout.max_staleness" in summary and "hf" in summary and "39 / 1" in summary
    assert "debug/steps-rank1.jsonl (40 steps)" in summary
    assert str(REJECTED_STEP) in sections["guard"].text and "guard.max_update_ratio" in sections["guard"].text
    assert "worker-a" in sections["throughput"].text and "worker-b" in sections["throughput"].text


def test_old_run_without_debugger_degrades(tmp_path):
    run = _old_metrics_only_run(tmp_path / "old")
    out = tmp_path / "elsewhere" / "page.html"
    assert main([str(run), "--out", str(out)]) == 0
    sections, _ = parse_page(out.read_text())
    assert tuple(sections) == SECTION_IDS
    for sid in ("summary", "staleness", "logprobs", "anomalies", "throughput"):
        assert "Missing" in sections[sid].text, sid
    assert "config.json" in sections["summary"].text and "debug/" in sections["anomalies"].text
    assert sections["curves"].images and sections["logprobs"].images  # reward/loss and mismatch/abs_diff_*


def test_resumed_run_keeps_last_line_per_step_and_ignores_a_torn_tail(tmp_path):
    run = make_run(tmp_path / "resumed", steps=10, debug=False)
    lines = (run / "metrics.jsonl").read_bytes().splitlines(keepends=True)
    (run / "metrics.jsonl").write_bytes(b"".join(lines) + b"".join(lines[6:]) + lines[0][:20])
    sections, _ = parse_page(write_report(run).read_text())
    assert "10 (steps 1..10)" in sections["summary"].text


def test_missing_or_empty_metrics_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(ValueError, match="metrics.jsonl"):
        write_report(tmp_path / "nothing")
    assert main([str(tmp_path / "nothing")]) != 0
    assert "metrics.jsonl" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_bytes(b"\n")
    with pytest.raises(ValueError, match="empty"):
        write_report(tmp_path)
    assert main([str(tmp_path)]) != 0
    assert "empty" in capsys.readouterr().err

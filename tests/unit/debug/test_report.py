"""Tests for asyncrl.debug.report: the page's sections, embedded figures, dump links and missing inputs."""

from __future__ import annotations

import base64
import re
from pathlib import Path
from urllib.parse import unquote

import orjson
import pytest

from asyncrl.debug.report import main, write_report
from tests._synthetic_run import ANOMALIES, HOSTILE, LONG_PROMPT, REJECTED_STEP, make_run, parse_page

SECTION_IDS = ("summary", "curves", "staleness", "logprobs", "guard", "anomalies", "samples", "throughput")
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
    dumps = [href for href in sections["anomalies"].links if not href.startswith("#")]
    targets = [(page.parent / unquote(href)).resolve() for href in dumps]
    assert targets == [(run / "dumps" / name).resolve() for *_, name in ANOMALIES]
    assert all(t.is_file() for t in targets)


def test_anomalies_point_to_their_batch_in_the_samples_table(full):
    _, page = full
    text = page.read_text()
    sections, _ = parse_page(text)
    anchors = [href for href in sections["anomalies"].links if href.startswith("#")]
    assert anchors == [f"#samples-step{s}-rank{r}" for s, r, *_ in ANOMALIES]
    for anchor in anchors:  # each resolves to the heading of its batch's rows in the samples section
        assert f'<h3 id="{anchor[1:]}">' in text


def test_samples_table_shows_the_last_sampled_steps_and_the_anomalies_batches_escaped(full):
    _, page = full
    text = page.read_text()
    sections, _ = parse_page(text)
    samples = sections["samples"].text
    shown = re.findall(r"step (\d+), rank (\d+)", samples)
    assert shown == [("9", "0"), ("20", "0"), ("20", "1"), ("23", "1"), ("30", "0"), ("30", "1"), ("40", "0"),
                     ("40", "1")]  # the last 3 sampled steps (both ranks) and each anomaly's batch, in step order
    assert "56 rollouts" in samples and "exact" in samples and "rollout logprob" in samples
    assert HOSTILE in samples  # as text, not markup
    assert "<script" not in text and "&lt;/td&gt;&lt;/tr&gt;&lt;script&gt;" in text
    assert f"<details><summary>{LONG_PROMPT[:80]}" in text and LONG_PROMPT in samples  # folded, whole


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
    for sid in ("summary", "staleness", "logprobs", "anomalies", "samples", "throughput"):
        assert "Missing" in sections[sid].text, sid
    assert "config.json" in sections["summary"].text and "debug/" in sections["anomalies"].text
    assert sections["curves"].images and sections["logprobs"].images  # reward/loss and mismatch/abs_diff_*


def test_resumed_run_keeps_last_line_per_step_and_ignores_a_torn_tail(tmp_path):
    run = make_run(tmp_path / "resumed", steps=10, debug=False)
    lines = (run / "metrics.jsonl").read_bytes().splitlines(keepends=True)
    (run / "metrics.jsonl").write_bytes(b"".join(lines) + b"".join(lines[6:]) + lines[0][:20])
    sections, _ = parse_page(write_report(run).read_text())
    assert "10 (steps 1..10)" in sections["summary"].text


def test_a_run_whose_updates_were_mostly_rejected_says_so_at_the_top(tmp_path):
    run = make_run(tmp_path / "rejected", steps=10, debug=False)
    rows = [orjson.loads(line) for line in (run / "metrics.jsonl").read_bytes().splitlines()]
    for r in rows[3:]:
        r.update(accepted=False, guard_reason="update_ratio=0.2 > guard.max_update_ratio=0.05")
    (run / "metrics.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    text = write_report(run).read_text()
    summary = parse_page(text)[0]["summary"].text
    assert "MOST UPDATES WERE REJECTED: 7 of 10" in summary and 'class="alarm"' in text
    assert "lower train.lr (now 0.001) or raise guard.max_update_ratio" in summary
    healthy = write_report(make_run(tmp_path / "healthy", steps=10, debug=False)).read_text()
    assert 'class="alarm"' not in healthy


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

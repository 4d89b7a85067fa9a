"""``asyncrl report RUN_DIR``: one self-contained HTML page, and its PNGs, describing a run.

It reads what a run of ``recipes/grpo.py`` leaves in its directory:

- ``metrics.jsonl`` (required): the trainer's line per step (rank 0): reward, loss, staleness, guard verdict,
  timings and the pipeline's cumulative counters;
- ``config.json``: the recipe config, for the summary;
- ``debug/steps-rank{r}.jsonl``: the debugger's per-step record; rank 0's is plotted (reward band, fixed-edge
  logprob histograms), the other ranks' files are listed;
- ``debug/anomalies.jsonl``: the detectors' findings, each linked to its ``dumps/*.msgpack`` and to the bad batch's
  rollouts in the samples table;
- ``samples.jsonl``: sample rollouts (``asyncrl.debug.samples``), shown as a table: prompt and completion text, each
  reward component, rollout logprob, version and staleness, for the last sampled steps and every anomaly's batch;

and writes ``RUN_DIR/report/index.html`` with one PNG per figure next to it. The page needs nothing else:
figures are embedded as base64 ``data:`` URIs, the CSS is inline, there is no script and no external URL, and
dump links are relative to the page so they work in a copied folder. Every input but ``metrics.jsonl`` is
optional: a section whose input is absent (an old run, a run without the debugger) says what is missing.

A resumed run appends the steps it redoes to the logs; the report keeps the last line of each step. It is an
offline reader and waits on nothing: on a live run it reports the steps written so far (a half-written last
line is ignored). Figures are drawn on bare ``matplotlib.figure.Figure`` objects (Agg, no pyplot state).
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import os
import re
import sys
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson
from matplotlib.figure import Figure

from asyncrl.debug._jsonl import last_per_step, read_jsonl
from asyncrl.debug.summary import alarm, run_summary

__all__ = ["SECTIONS", "main", "write_report"]

DPI = 90
"""Figure resolution; with the sizes below a 200-step run's page stays well under 3 MB."""
HEATMAP_METRICS = ("logprob_diff", "importance_ratio")
"""The per-step Summaries whose histogram edges are fixed across steps (the others' are per step)."""
CONFIG_FIELDS = (
    ("rollout", "max_staleness"), ("rollout", "group_size"), ("rollout", "batch_size"), ("rollout", "num_workers"),
    ("rollout", "worker", "engine", "type"), ("train", "steps"), ("train", "lr"), ("train", "parallel"),
    ("lora", "rank"), ("guard", "max_update_ratio"),
)
_CSS = """
body{font-family:system-ui,sans-serif;margin:1.5em auto;max-width:1100px;color:#222;padding:0 1em}
nav a{margin-right:1em} section{border-top:1px solid #ccc;margin-top:1.5em}
table{border-collapse:collapse;font-size:.9em;margin:.5em 0}
th,td{border:1px solid #ddd;padding:.2em .6em;text-align:left;vertical-align:top} th{background:#f3f3f3}
figure{margin:.5em 0} img{max-width:100%} .missing{color:#a15c00;font-style:italic} .none{color:#2a7a2a}
td.text{white-space:pre-wrap;font-family:ui-monospace,monospace;max-width:32em;word-break:break-word}
.alarm{color:#b00020;font-weight:bold}
"""
SAMPLE_STEPS = 3
"""The samples table shows the rows of the last this many periodic sample steps (all ranks), besides every
anomaly's batch."""
SAMPLE_ROWS = 32
"""At most this many rows of one (step, rank) block; the rest is in ``samples.jsonl``."""
MAX_ANOMALY_BLOCKS = 10
"""At most this many anomalies' batches are shown (the first ones; every anomaly's rows are in samples.jsonl)."""


@dataclass(slots=True)
class _Run:
    """What the report reads from a run directory; optional inputs are ``None`` (or empty) when absent."""

    run_dir: Path
    metrics: list[dict[str, Any]]
    config: dict[str, Any] | None
    records: list[dict[str, Any]]
    record_files: dict[int, tuple[Path, int]]
    anomalies: list[dict[str, Any]] | None
    samples: list[dict[str, Any]]


class _Html(str):
    """A table cell that is already HTML (its text escaped by whoever built it)."""


class _Text(_Html):
    """A cell of text a model wrote or read (already escaped): shown verbatim, wrapped, in a monospace font."""


# -- reading ---------------------------------------------------------------------------------------------------------
def _load(run_dir: Path) -> _Run:
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        raise ValueError(f"no {metrics_path}: is {str(run_dir)!r} the run_dir of a recipes/grpo.py run?")
    metrics = last_per_step(read_jsonl(metrics_path))
    if not metrics:
        raise ValueError(f"{metrics_path} is empty: the run has not logged a step yet")
    config_path = run_dir / "config.json"
    debug = run_dir / "debug"
    named = ((re.fullmatch(r"steps-rank(\d+)\.jsonl", p.name), p) for p in debug.glob("steps-rank*.jsonl"))
    ranked = {int(m[1]): p for m, p in named if m}
    per_rank = {r: last_per_step(read_jsonl(ranked[r])) for r in sorted(ranked)}
    anomalies_path = debug / "anomalies.jsonl"
    return _Run(
        run_dir=run_dir,
        metrics=metrics,
        config=orjson.loads(config_path.read_bytes()) if config_path.is_file() else None,
        records=per_rank.get(0, []),
        record_files={r: (ranked[r], len(rows)) for r, rows in per_rank.items()},
        anomalies=read_jsonl(anomalies_path) if anomalies_path.is_file() else ([] if debug.is_dir() else None),
        samples=read_jsonl(run_dir / "samples.jsonl"),
    )


def _get(row: Any, *keys: str) -> Any:
    for key in keys:
        row = row.get(key) if isinstance(row, dict) else None
    return row


def _series(rows: list[dict[str, Any]], *keys: str) -> np.ndarray | None:
    """A float per row (NaN where absent), or None when no row has a number there."""
    values = [_get(r, *keys) for r in rows]
    out = np.array([v if isinstance(v, (int, float)) else np.nan for v in values], dtype=float)
    return out if np.isfinite(out).any() else None


# -- HTML pieces -----------------------------------------------------------------------------------------------------
def _fmt(value: Any) -> str:
    if value is None:
        return "n/a"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _missing(what: str) -> str:
    return f'<p class="missing">Missing: {html.escape(what)}</p>'


def _none(what: str) -> str:
    return f'<p class="none">{html.escape(what)}</p>'


def _cell(value: Any) -> str:
    return value if isinstance(value, _Html) else html.escape(_fmt(value))


def _table(header: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    td = lambda v: '<td class="text">' if isinstance(v, _Text) else "<td>"  # noqa: E731
    body = "".join("<tr>" + "".join(f"{td(v)}{_cell(v)}</td>" for v in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _embed(fig: Figure, out_dir: Path, name: str) -> str:
    """Writes the figure as ``out_dir/name.png`` and returns it as an inline ``<img>``."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    data = buf.getvalue()
    (out_dir / f"{name}.png").write_bytes(data)
    uri = "data:image/png;base64," + base64.b64encode(data).decode("ascii")
    return f'<figure><img src="{uri}" alt="{html.escape(name)}"></figure>'


def _figure(ncols: int, height: float = 2.8) -> tuple[Figure, list[Any]]:
    fig = Figure(figsize=(min(4.2 * ncols, 12.0), height), layout="constrained")
    return fig, list(fig.subplots(1, ncols, squeeze=False)[0])


def _lines(out_dir: Path, name: str, x: np.ndarray, panels: dict[str, dict[str, np.ndarray]],
           xlabel: str = "step", logy: bool = False) -> str:
    """A row of line panels over the same x: ``{panel title: {line label: y}}``."""
    fig, axes = _figure(len(panels))
    for ax, (title, lines) in zip(axes, panels.items()):
        for label, y in lines.items():
            y = np.where(y > 0, y, np.nan) if logy else y
            ax.plot(x, y, label=label, lw=1.2)
        ax.set(title=title, xlabel=xlabel, yscale="log" if logy else "linear")
        if len(lines) > 1:
            ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    return _embed(fig, out_dir, name)


def _bin_labels(edges: list[float]) -> list[str]:
    return [f"<{edges[0]:g}", *(f"[{a:g}, {b:g})" for a, b in zip(edges, edges[1:])), f"≥{edges[-1]:g}"]


def _heatmap(out_dir: Path, name: str, steps: np.ndarray, counts: np.ndarray, labels: list[str], title: str) -> str:
    """Steps across, bins up; each cell is the bin's fraction of its step's count (blank when zero)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        frac = counts / counts.sum(axis=1, keepdims=True)
    frac = np.ma.masked_where(~(frac > 0), frac)
    mid = (steps[:-1] + steps[1:]) / 2
    x = np.concatenate([[steps[0] - 0.5], mid, [steps[-1] + 0.5]])
    fig, (ax,) = _figure(1, height=0.5 + 0.17 * len(labels))
    fig.set_figwidth(9)
    mesh = ax.pcolormesh(x, np.arange(len(labels) + 1) - 0.5, frac.T, cmap="viridis", vmin=0, vmax=1)
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.set(title=title, xlabel="step")
    fig.colorbar(mesh, ax=ax, label="fraction of step", pad=0.01)
    return _embed(fig, out_dir, name)


def _stack(rows: list[dict[str, Any]], *keys: str) -> tuple[np.ndarray, np.ndarray] | None:
    """Steps and counts (steps x bins) of the rows holding a list of counts at ``keys`` as long as the first's."""
    found = [(r.get("step"), c) for r in rows if isinstance(c := _get(r, *keys), list) and c]
    if not found:
        return None
    found = [(s, c) for s, c in found if len(c) == len(found[0][1])]
    return np.array([s for s, _ in found], dtype=float), np.array([c for _, c in found], dtype=float)


def _summaries(records: list[dict[str, Any]], metric: str) -> tuple[list[dict[str, Any]], list[float]]:
    """The records whose Summary of ``metric`` has a histogram with the first one's edges, and those edges."""
    found = [r for r in records if _get(r, "dist", metric, "hist", "counts")]
    if not found:
        return [], []
    edges = found[0]["dist"][metric]["hist"]["edges"]
    same = lambda h: h["edges"] == edges and len(h["counts"]) == len(edges) + 1  # noqa: E731
    return [r for r in found if same(r["dist"][metric]["hist"])], edges


def _abs_quantile_bound(counts: np.ndarray, edges: list[float], q: float, max_abs: float) -> float:
    """An upper bound on the q-quantile of |x| from a histogram of x: the smallest bin bound |x| stays under."""
    lows, highs = [-np.inf, *edges], [*edges, np.inf]
    bounds = np.array([min(max(abs(lo), abs(hi)), max_abs) for lo, hi in zip(lows, highs)])
    order = np.argsort(bounds)
    cdf = np.cumsum(counts[order])
    return float(bounds[order][np.searchsorted(cdf, q * cdf[-1])])


# -- sections --------------------------------------------------------------------------------------------------------
def _summary(run: _Run, out_dir: Path) -> str:
    m = run.metrics
    verdicts = [r.get("accepted") for r in m]
    times = _series(m, "time")
    wall = "n/a" if times is None else f"{np.nanmax(times) - np.nanmin(times):.1f} s (first to last step logged)"
    said = run_summary(run.run_dir)
    reward = said["reward"]
    rows: list[list[Any]] = [
        ["steps", f"{len(m)} (steps {m[0].get('step')}..{m[-1].get('step')})"],
        ["final reward_mean", m[-1].get("reward_mean")],
        [f"reward, first / last {reward['window']} steps", f"{_fmt(reward['first'])} / {_fmt(reward['last'])}"],
        ["updates accepted / rejected", f"{verdicts.count(True)} / {verdicts.count(False)}"],
        *[[f"rejected: {kind}", f"{e['count']} (first at step {e['first_step']}: {e['example']}). Fix: {e['fix']}"]
          for kind, e in said["updates"]["rejected_by"].items()],
        ["anomalies", "missing (no debug/ folder)" if run.anomalies is None else len(run.anomalies)],
        ["wall-clock", wall],
        ["started", "n/a" if times is None else time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(np.nanmin(times)))],
    ]
    if run.config is not None:
        rows += [[f"config {'.'.join(path)}", _get(run.config, *path)] for path in CONFIG_FIELDS]
    pipeline = m[-1].get("pipeline") or {}
    rows += [[f"pipeline {k} (total)", v] for k, v in pipeline.items() if k != "workers"]
    files = [f"{p.relative_to(run.run_dir)} ({n} steps)" for p, n in run.record_files.values()]
    rows.append(["debugger records", ", ".join(files) or "missing (no debug/steps-rank*.jsonl)"])
    notes = "" if run.config is not None else _missing("config.json: no config highlights")
    loud = alarm(said)
    if loud:
        notes = "".join(f'<p class="alarm">{html.escape(line.strip("! "))}</p>' for line in loud.splitlines()
                        if line.strip("!")) + notes
    return notes + _table(["", "value"], rows)


def _curves(run: _Run, out_dir: Path) -> str:
    steps = _series(run.metrics, "step")
    reward, loss, times = (_series(run.metrics, k) for k in ("reward_mean", "loss", "time"))
    if reward is None and loss is None:
        return _missing("reward_mean and loss in metrics.jsonl")
    fig, (ax_r, ax_l) = _figure(2)
    if reward is not None:
        ax_r.plot(steps, reward, lw=1.2, label="mean (metrics)")
    p5, p95 = (_series(run.records, "dist", "reward", "q", q) for q in ("5", "95"))
    if p5 is not None and p95 is not None:
        ax_r.fill_between(_series(run.records, "step"), p5, p95, alpha=0.25, label="p5-p95 (debug record)")
    ax_r.set(title="reward", xlabel="step")
    ax_r.legend(fontsize=7)
    if loss is not None:
        ax_l.plot(steps, loss, lw=1.2)
        rejected = np.array([r.get("accepted") is False for r in run.metrics])
        ax_l.plot(steps[rejected], loss[rejected], "rx", label="rejected update")
        ax_l.legend(fontsize=7)
    ax_l.set(title="loss", xlabel="step")
    for ax in (ax_r, ax_l):
        ax.grid(alpha=0.3)
    html_out = _embed(fig, out_dir, "reward_loss")
    if p5 is None:
        html_out += _missing("reward p5-p95 band (no dist.reward in debug/steps-rank0.jsonl)")
    if reward is not None and times is not None:
        html_out += _lines(out_dir, "reward_wallclock", times - np.nanmin(times),
                           {"reward vs wall-clock": {"mean": reward}}, xlabel="seconds since the first step")
    return html_out


def _staleness(run: _Run, out_dir: Path) -> str:
    steps = _series(run.metrics, "step")
    lines = {k: y for k in ("staleness_mean", "staleness_max") if (y := _series(run.metrics, k)) is not None}
    out = _lines(out_dir, "staleness", steps, {"staleness (versions behind)": lines}) if lines else _missing(
        "staleness_mean / staleness_max in metrics.jsonl")
    hist, source = _stack(run.metrics, "staleness_hist"), "metrics.jsonl staleness_hist"
    if hist is None:  # older metrics: the debugger's record has the same histogram
        hist, source = _stack(run.records, "version_lag", "hist"), "debug record version_lag.hist"
    if hist is None:
        return out + _missing("staleness_hist in metrics.jsonl and version_lag in debug/steps-rank0.jsonl")
    nbins = hist[1].shape[1]
    labels = [*map(str, range(nbins - 1)), f"{nbins - 1}+"]
    return out + _heatmap(out_dir, "staleness_hist", *hist, labels, f"staleness histogram ({source})")


def _logprobs(run: _Run, out_dir: Path) -> str:
    out = ""
    for metric in HEATMAP_METRICS:
        records, edges = _summaries(run.records, metric)
        if not records:
            out += _missing(f"dist.{metric}.hist in debug/steps-rank0.jsonl")
            continue
        steps, counts = _stack(records, "dist", metric, "hist", "counts")
        title = "logprob_diff (trainer - rollout)" if metric == "logprob_diff" else metric
        out += _heatmap(out_dir, f"{metric}_hist", steps, counts, _bin_labels(edges), title)
    records, edges = _summaries(run.records, "logprob_diff")
    lines: dict[str, np.ndarray] = {}
    if records:
        x = _series(records, "step")
        diffs = [r["dist"]["logprob_diff"] for r in records]
        max_abs = [max(abs(d["min"]), abs(d["max"])) if d["n"] else np.nan for d in diffs]
        for q in (0.5, 0.99):
            lines[f"p{q * 100:g} |diff| (bin edge)"] = np.array([
                _abs_quantile_bound(np.array(d["hist"]["counts"], dtype=float), edges, q, mx) if d["n"] else np.nan
                for d, mx in zip(diffs, max_abs)])
        lines["max |diff|"] = np.array(max_abs, dtype=float)
    else:  # no debugger: the trainer's own mismatch metrics, when it logged them
        x = _series(run.metrics, "step")
        lines = {f"{k} (metrics)": y for k in ("mismatch/abs_diff_mean", "mismatch/abs_diff_max")
                 if (y := _series(run.metrics, k)) is not None}
    if not lines:
        return out + _missing("|diff| quantiles (no debug record, no mismatch/abs_diff_* in metrics.jsonl)")
    note = "<p>p50 and p99 are read off the fixed-edge histogram: each is the upper edge of its bin.</p>"
    return out + _lines(out_dir, "logprob_absdiff", x, {"|trainer - rollout logprob|": lines}, logy=True) + (
        note if records else "")


def _guard(run: _Run, out_dir: Path) -> str:
    if not any("accepted" in r for r in run.metrics):
        return _missing("accepted in metrics.jsonl")
    rows = [[r.get("step"), r.get("guard_reason", ""), r.get("update_ratio")]
            for r in run.metrics if r.get("accepted") is False]
    return _table(["step", "reason", "update_ratio"], rows) if rows else _none("none: every update was accepted")


def _dump_link(run: _Run, out_dir: Path, dump: str | None) -> Any:
    if not dump:
        return ""
    target = run.run_dir / dump
    if not target.exists():
        return f"{dump} (file missing)"
    href = urllib.parse.quote(Path(os.path.relpath(target, out_dir)).as_posix())
    return _Html(f'<a href="{html.escape(href)}">{html.escape(dump)}</a>')


def _anomalies(run: _Run, out_dir: Path) -> str:
    if run.anomalies is None:
        return _missing("debug/anomalies.jsonl (no debug/ folder: the run had no debugger)")
    if not run.anomalies:
        return _none("none")
    shown = {(b[0], b[1]) for b in _sample_blocks(run)}
    rows = [[a.get("step"), a.get("rank"), a.get("kind"), a.get("detail"), _dump_link(run, out_dir, a.get("dump")),
             _samples_link(a.get("samples"), shown)] for a in run.anomalies]
    return _table(["step", "rank", "kind", "detail", "dump", "samples"], rows)


def _samples_link(ref: dict[str, Any] | None, shown: set[tuple[Any, Any]]) -> Any:
    if not ref:
        return ""
    key = (ref.get("step"), ref.get("rank"))
    where = f"{ref.get('file', 'samples.jsonl')}, step {key[0]}, rank {key[1]}"
    if key not in shown:
        return f"{where} (not shown here)"
    return _Html(f'<a href="#{_anchor(*key)}">{html.escape(where)}</a>')


def _anchor(step: Any, rank: Any) -> str:
    return f"samples-step{step}-rank{rank}"


def _sample_blocks(run: _Run) -> list[tuple[Any, Any, str, list[dict[str, Any]]]]:
    """``(step, rank, why, rows)`` of the blocks the samples table shows: the last ``SAMPLE_STEPS`` periodic sample
    steps and the first ``MAX_ANOMALY_BLOCKS`` anomalies' batches, in step order."""
    blocks: dict[tuple[Any, Any], list[dict[str, Any]]] = {}
    for row in run.samples:
        blocks.setdefault((row.get("step"), row.get("rank")), []).append(row)
    why = {key: rows[0].get("why", "every") for key, rows in blocks.items()}
    periodic = sorted({k[0] for k in blocks if why[k] != "anomaly"}, key=lambda s: s or 0)[-SAMPLE_STEPS:]
    anomalous = sorted((k for k in blocks if why[k] == "anomaly"), key=lambda k: (k[0] or 0, k[1] or 0))
    keep = {k for k in blocks if k[0] in periodic and why[k] != "anomaly"} | set(anomalous[:MAX_ANOMALY_BLOCKS])
    return [(k[0], k[1], why[k], blocks[k]) for k in sorted(keep, key=lambda k: (k[0] or 0, k[1] or 0))]


def _text_cell(text: Any, preview: int = 80) -> _Text:
    """Text a model wrote or read, escaped, verbatim; a long one folded behind its first characters."""
    text = "" if text is None else str(text)
    if len(text) <= preview:
        return _Text(html.escape(text))
    return _Text(f"<details><summary>{html.escape(text[:preview])}…</summary>{html.escape(text)}</details>")


def _samples(run: _Run, out_dir: Path) -> str:
    if not run.samples:
        return _missing("samples.jsonl (debug.samples_every=0, or a run from before samples were written)")
    blocks = _sample_blocks(run)
    names = sorted({k for _, _, _, rows in blocks for r in rows for k in (r.get("rewards") or {})})
    header = ["uid", "version", "staleness", "reward", *names, "advantage", "rollout logprob", "tokens", "finish",
              "prompt", "completion"]
    total = len({(r.get("step"), r.get("rank")) for r in run.samples})
    out = (f"<p>{len(run.samples)} rollouts of {total} (step, rank) samples in samples.jsonl; shown: the last "
           f"{SAMPLE_STEPS} sampled steps and the batches of anomalies. Prompt and completion are the token ids "
           "decoded with the run's tokenizer.</p>")
    for step, rank, why, rows in blocks:
        title = f"step {step}, rank {rank}" + (" (an anomaly's batch)" if why == "anomaly" else "")
        body = [[r.get("uid"), r.get("policy_version"), r.get("staleness"), r.get("reward"),
                 *((r.get("rewards") or {}).get(n) for n in names), r.get("advantage"), r.get("rollout_logprob"),
                 r.get("response_tokens"), r.get("finish_reason"), _text_cell(r.get("prompt")),
                 _text_cell(r.get("completion"))] for r in rows[:SAMPLE_ROWS]]
        more = f"<p>{len(rows) - SAMPLE_ROWS} more rows in samples.jsonl</p>" if len(rows) > SAMPLE_ROWS else ""
        out += f'<h3 id="{_anchor(step, rank)}">{html.escape(title)}</h3>' + _table(header, body) + more
    return out


def _workers(run: _Run, out_dir: Path) -> str:
    last = next((w for r in reversed(run.metrics) if (w := _get(r, "pipeline", "workers"))), None)
    if not last:
        return _missing("pipeline.workers in metrics.jsonl: no per-worker utilisation")
    names = sorted(last)
    util = [(_get(last, w, "busy_s") or 0) / max(_get(last, w, "uptime_s") or 0, 1e-9) for w in names]
    fig, (ax,) = _figure(1, height=0.8 + 0.3 * len(names))
    fig.set_figwidth(6)
    ax.barh(names, util)
    ax.set(title="worker utilisation (busy_s / uptime_s, last step)", xlim=(0, 1))
    ax.tick_params(axis="y", labelsize=7)
    keys = ["busy_s", "uptime_s", "weight_apply_s", "rollouts_sent", "tokens_generated", "policy_version"]
    rows = [[w, f"{u:.1%}", *(_get(last, w, k) for k in keys)] for w, u in zip(names, util)]
    return _embed(fig, out_dir, "worker_utilisation") + _table(["worker", "utilisation", *keys], rows)


def _throughput(run: _Run, out_dir: Path) -> str:
    m = run.metrics
    steps = _series(m, "step")
    step_s, wait_s, tokens = (_series(m, k) for k in ("step_s", "wait_s", "tokens"))
    wanted = {
        "rollouts/s": _series(m, "rollouts_per_s"),
        "tokens/s": None if tokens is None or step_s is None else tokens / step_s,
        "trainer wait fraction (wait_s / step_s)": None if wait_s is None or step_s is None else wait_s / step_s,
    }
    panels = {title: {title: y} for title, y in wanted.items() if y is not None}
    out = _lines(out_dir, "throughput", steps, panels) if panels else ""
    if absent := [title for title, y in wanted.items() if y is None]:
        out += _missing(f"{', '.join(absent)}: keys absent in metrics.jsonl")
    out += _workers(run, out_dir)
    publish_s, weight_bytes = _series(m, "publish_s"), _series(m, "weight_bytes")
    sync = {"weight sync publish_s": publish_s, "weight sync MB": None if weight_bytes is None else weight_bytes / 1e6}
    if absent := [title for title, y in sync.items() if y is None]:
        out += _missing(f"{', '.join(absent)}: publish_s / weight_bytes absent in metrics.jsonl")
    panels = {title: {title: y} for title, y in sync.items() if y is not None}
    return out + (_lines(out_dir, "weight_sync", steps, panels) if panels else "")


# -- the page --------------------------------------------------------------------------------------------------------
SECTIONS = {
    "summary": ("Summary", _summary), "curves": ("Reward and loss", _curves), "staleness": ("Staleness", _staleness),
    "logprobs": ("Rollout vs trainer logprobs", _logprobs), "guard": ("Update guard", _guard),
    "anomalies": ("Anomalies", _anomalies), "samples": ("Samples", _samples), "throughput": ("Throughput", _throughput),
}
"""Section id -> (heading, builder); builders return the section's HTML and write its PNGs."""


def write_report(run_dir: Path, out: Path | None = None) -> Path:
    """Writes the run's HTML report and its PNGs.

    Args:
        run_dir: the run directory (``run_dir`` of the recipe config); needs a non-empty ``metrics.jsonl``.
        out: the HTML file to write; default ``run_dir/report/index.html``. PNGs go in the same folder.

    Returns:
        The path of the HTML file.

    Raises:
        ValueError: ``run_dir`` has no ``metrics.jsonl``, or it has no step, or a line in the middle is not JSON.
    """
    run_dir = Path(run_dir)
    out = Path(out) if out is not None else run_dir / "report" / "index.html"
    run = _load(run_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    sections = "".join(f'<section id="{sid}"><h2>{html.escape(title)}</h2>{build(run, out.parent)}</section>'
                       for sid, (title, build) in SECTIONS.items())
    nav = "".join(f'<a href="#{sid}">{html.escape(title)}</a>' for sid, (title, _) in SECTIONS.items())
    title = html.escape(f"asyncrl report: {run_dir.resolve().name}")
    page = (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{title}</title>'
            f"<style>{_CSS}</style></head><body><h1>{title}</h1><nav>{nav}</nav>{sections}</body></html>")
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(page, encoding="utf-8")
    os.replace(tmp, out)  # a reader never sees half a page
    return out


def main(argv: list[str]) -> int:
    """``asyncrl report RUN_DIR [--out FILE]``; returns the exit status (1 when the run cannot be read)."""
    parser = argparse.ArgumentParser(prog="asyncrl report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, help="the run directory (holds metrics.jsonl)")
    parser.add_argument("--out", type=Path, help="HTML file to write (default: RUN_DIR/report/index.html)")
    args = parser.parse_args(argv)
    try:
        path = write_report(args.run_dir, args.out)
    except ValueError as e:
        print(f"asyncrl report: error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0

"""The benchmark pages' result tables, from the newest result file of each benchmark.

Every benchmark script writes a self-describing JSON file into ``benchmarks/results/`` (its ``benchmark`` name,
its config, the machine, a ``date`` or ``time``). A *series* is one kind of run of one benchmark (e.g. freshness in
measured mode; weight deltas of a LoRA adapter): a predicate on those files. For each series the newest file (by
the date it records, not by the file's name or mtime) is rendered into a table, inside the generated block of the
benchmark's page under ``docs/benchmarks/``; the headline of each benchmark fills a column of the index in
``benchmarks/README.md`` and the three numbers of ``README.md``. Adding a result file is all it takes to update
them: ``python -m docs._gen benchmarks``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from docs._gen._text import DOCS, ROOT, replace_block, table

RESULTS = ROOT / "benchmarks" / "results"
PAGES = DOCS / "benchmarks"
INDEX = ROOT / "benchmarks" / "README.md"
README = ROOT / "README.md"


# -- reading -------------------------------------------------------------------------------------------------------------
@dataclass(slots=True)
class Result:
    path: Path
    data: dict[str, Any]

    @property
    def when(self) -> float:
        """When the run ended, from the file's own ``date`` (ISO) or ``time`` (epoch seconds)."""
        if isinstance(self.data.get("date"), str):
            stamp = datetime.fromisoformat(self.data["date"])
            return (stamp if stamp.tzinfo else stamp.replace(tzinfo=timezone.utc)).timestamp()
        return float(self.data.get("time", 0.0))

    @property
    def rel(self) -> str:
        return str(self.path.relative_to(ROOT)) if self.path.is_relative_to(ROOT) else str(self.path)

    @property
    def gpu(self) -> bool:
        machine = self.data.get("machine") or {}
        return bool(machine.get("cuda")) or "+cu" in str(machine.get("torch", ""))

    def machine(self) -> str:
        m = self.data.get("machine") or {}
        parts = [f"{m['cpu_count']} CPUs" if m.get("cpu_count") else None, f"torch {m['torch']}" if m.get("torch") else None,
                 f"CUDA {m['cuda']}" if m.get("cuda") else None]
        return ", ".join(p for p in parts if p) or "machine not recorded"


def load_results(root: Path = RESULTS) -> list[Result]:
    out = []
    for path in sorted(root.rglob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and isinstance(data.get("benchmark"), str):
            out.append(Result(path, data))
    return out


# -- formatting ----------------------------------------------------------------------------------------------------------
def med(v: Any) -> float | None:
    return v.get("median") if isinstance(v, dict) else v


def f(v: Any, digits: int = 2, suffix: str = "") -> str:
    v = med(v)
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}{suffix}"
    return f"{v:,.{digits}f}{suffix}"


def x(v: Any, digits: int = 2) -> str:
    return f(v, digits, "×")


def rng(v: Any, digits: int = 1) -> str:
    """median (min–max) of a ``{median, min, max}`` summary."""
    if not isinstance(v, dict) or v.get("min") is None:
        return f(v, digits)
    return f"{f(v['median'], digits)} ({f(v['min'], digits)}–{f(v['max'], digits)})"


# -- renderers: one per series, each Result -> (table markdown, headline) -------------------------------------------------
def data_plane(r: Result) -> tuple[str, str]:
    metrics, ratios = r.data["metrics"], r.data.get("ratios", {})
    rows = []
    for path, m in metrics.items():
        ratio = ratios.get(f"asyncrl/{path}", {})
        target = ratio.get("target")
        rows.append([f"`{path}`", rng(m["rollouts_per_s"], 0), f(med(m.get("mb_per_s")), 1),
                     x(ratio.get("value")) if ratio else ("1.00×" if path == "asyncrl" else "–"),
                     f"≥ {target}×: {'met' if ratio.get('met') else 'missed'}" if target is not None else ""])
    c = r.data["config"]
    note = (f"{c['workers']} producer processes, groups of {c['group_size']}, {c['prompt_tokens']} prompt + "
            f"{c['response_tokens']} response tokens a rollout, {c['repeats']} windows of {c['seconds']:g} s.")
    tbl = table(["path", "rollouts/s, median (min–max)", "MB/s", "asyncrl ÷ path", "target"], rows)
    names = {"asyncrl/mp_queue": "`multiprocessing.Queue`", "asyncrl/ray_actor": "a Ray actor queue"}
    head = " and ".join(f"{x(ratios[k]['value'])} {name}" for k, name in names.items() if k in ratios)
    head = f"{head}, in rollouts/s into a training loop" if head else ""
    return note + "\n\n" + tbl, head


def weight_sync(r: Result) -> tuple[str, str]:
    rows, head = [], ""
    if "results" in r.data:  # one entry per size, then per "backend xN"
        for size, entries in r.data["results"].items():
            for name, e in entries.items():
                if not isinstance(e, dict) or "latency_s" not in e:
                    continue
                rows.append([size, f"`{name}`", f(e.get("receivers")), f(med(e["latency_s"]), 3), f(med(e["gb_per_s"])),
                             x(e.get("x_memcpy")), x(e.get("x_memcpy_staged"))])
                if name == "shm-shadow x1" or (not head and name.startswith("shm x1")):
                    head = f"{x(e.get('x_memcpy'))} memcpy ({name}, {size})"
        header = ["size", "path", "receivers", "latency (s)", "GB/s", "× memcpy", "× memcpy, staged"]
    else:  # the first format: metrics[path][size]
        for name, sizes in r.data["metrics"].items():
            for size, e in sizes.items():
                rows.append([size, f"`{name}`", f(med(e["latency_s"]), 4), f(med(e["gb_per_s"]))])
        header = ["size", "path", "latency (s)", "GB/s"]
    note = "End to end: publish until every receiver's engine holds the version, verified; medians over repeats."
    return note + "\n\n" + table(header, rows), head


def weight_delta(r: Result) -> tuple[str, str]:
    z, codec, c = r.data["zmq"], r.data["codec"], r.data["config"]
    rows = [[kind, f(e["bytes"]), f(e["latency_s"], 3), f(e["cpu_s"], 3)] for kind, e in
            (("full", z["full"]), ("delta", z["delta"]))]
    note = (f"{c['params_built']:,} parameters ({c['master']}), one AdamW step at lr {c['lr']:g} "
            f"({r.data['step']['fraction']:.1%} of elements changed), zmq over loopback TCP, median of "
            f"{c['repeats']} updates. Codec alone: {x(codec['ratio'], 1)} fewer bytes, encode "
            f"{f(codec['encode_gb_per_s'])} GB/s, decode {f(codec['decode_gb_per_s'])} GB/s.")
    tbl = table(["update", "bytes", "latency (s)", "CPU (s)"], rows)
    tail = (f"\n\nDelta against full: {x(z['bytes_ratio'], 1)} fewer bytes, {x(z['speedup'])} faster, "
            f"{x(z['cpu_ratio'])} less CPU.")
    return note + "\n\n" + tbl + tail, f"{x(z['bytes_ratio'], 1)} fewer bytes, {x(z['speedup'])} faster"


def weight_delta_lora(r: Result) -> tuple[str, str]:
    rows = [[e["dtype"].replace("torch.", ""), f(e["rank"]), f"{e['lr']:g}", f(e["steps"]), f(e["changed_fraction"], 3),
             f(e["full_bytes"]), f(e["delta_bytes"]), x(e["ratio"])] for e in r.data["lora"]]
    return table(["dtype", "rank", "lr", "steps", "changed fraction", "full bytes", "delta bytes", "ratio"], rows), ""


def weight_fanout(r: Result) -> tuple[str, str]:
    c, res, ratios = r.data["config"], r.data["results"], r.data.get("ratios", {})
    rows = []
    for path in ("relay", "direct"):
        entries = res.get(path) or {}
        one = entries[min(entries, key=int)] if entries else None
        for n, e in sorted(entries.items(), key=lambda kv: int(kv[0])):
            rows.append([f(int(n)), f"`{path}`", f(e["workers"]), f(e["bytes_per_update"] / 1e6, 1),
                         x(e["bytes_over_size"]), rng(e["latency_s"], 3),
                         x(e["latency_s"]["median"] / one["latency_s"]["median"]) if one else "–",
                         rng(e["nodes_hold_s"], 3) if "nodes_hold_s" in e else "–", f(e["cpu_s"]["median"])])
    note = (f"A {c['mb']} MiB model (float32) in {c['bucket_mb']} MiB buckets, zmq over loopback TCP, "
            f"{c['workers_per_node']} worker processes per simulated node, median (min–max) of {c['repeats']} updates "
            "after 2 warm-up ones. Every node shares this machine's cores")
    loads = [s["loadavg_1m"] for e in res.values() for n in e.values() for s in n.get("samples", [])
             if "loadavg_1m" in s]
    note += f" (1-minute load average {min(loads):.1f}–{max(loads):.1f} during the run)." if loads else "."
    tbl = table(["nodes", "path", "workers", "MB per update", "÷ model", "every worker holds it (s)", "÷ 1 node",
                 "every node holds it (s)", "CPU s"], rows)
    t = ratios.get("relay_time_most_over_one")
    tail = ""
    if t:
        tail = (f"\n\nWith the relay: {t['nodes'][1]} nodes take {x(t['value'])} the time of {t['nodes'][0]} "
                f"(target ≤ {t['target']}×: {'met' if t['met'] else 'missed'}).")
    per_node = ratios.get("relay_bytes_over_nodes_x_size", {})
    head = ""
    if per_node:
        worst = max(per_node.values())
        head = f"{x(worst)} nodes × model bytes per update with the relay"
        if t:
            head += f"; {t['nodes'][1]} nodes take {x(t['value'])} one node's time"
    return note + "\n\n" + tbl + tail, head


def _freshness_points(r: Result) -> tuple[str, str]:
    rows = []
    for p in r.data["points"]:
        m = p["metrics"]
        rows.append([f(p["max_staleness"]), f(p["workers"]), rng(m["rollouts_per_s"]), x(p["speedup"]),
                     f(p["efficiency"]), f(p.get("efficiency_window")), f(m["gen_capacity"], 0), f(m["train_capacity"], 0),
                     f(m["trainer_idle"]), f(m["worker_idle"]), f(m["staleness_mean"]), f(m["regenerated_frac"], 3)])
    tbl = table(["k", "workers", "trained rollouts/s", "speedup vs k=0", "efficiency", "eff. vs window", "G", "T",
                 "trainer idle", "worker idle", "staleness", "regenerated"], rows)
    best = max(r.data["points"], key=lambda p: p["speedup"])
    return tbl, f"{x(best['speedup'])} over synchronous at k = {best['max_staleness']}"


def freshness_measured(r: Result) -> tuple[str, str]:
    c = r.data["config"]
    note = (f"The real recipe, {c['ranks']} trainer rank(s), `{c['engine']}` workers, {c['steps']} steps "
            f"({c['warmup']} warm-up), {c['repeats']} repeat(s); median (min–max) over repeats.")
    tbl, head = _freshness_points(r)
    return note + "\n\n" + tbl, head + " (measured)"


def freshness_simulated(r: Result) -> tuple[str, str]:
    c = r.data["config"]
    how = "rates calibrated from a measured run" if c.get("calibrate") else "rates given on the command line"
    note = f"Simulated ({how}), {c['steps']} steps, {c['repeats']} repeat(s); rates per modelled second."
    tbl, head = _freshness_points(r)
    return note + "\n\n" + tbl, head + " (simulated)"


def streaming(r: Result) -> tuple[str, str]:
    rows = []
    for p in r.data["streaming_vs_static"]:
        occ, rps = p["occupancy"], p["rollouts_per_s"]
        pause = p.get("inflight_pause_s", {})
        rows.append([f(p["max_staleness"]), f(p["workers"]), f(rps["static"]), f(rps["streaming"]),
                     x(p["streaming_over_static"]), f"{f(occ['static'])} → {f(occ['streaming'])}",
                     f"{f(pause.get('p50'), 3)} / {f(pause.get('p99'), 3)}",
                     f"{f(p['regenerated_frac']['static'])} / {f(p['regenerated_frac']['streaming'])}"])
    c = r.data["config"]
    engine = c.get("engine", "fake") if r.data.get("mode") == "measured" else "fake (simulated)"
    note = (f"{r.data.get('mode', '').capitalize()}, engine `{engine}`, {c['steps']} steps, {c['repeats']} repeat(s)"
            + (f"; overrides: {', '.join(f'`{s}`' for s in c['set'])}" if c.get("set") else "") + ".")
    tbl = table(["k", "workers", "static rollouts/s", "streaming rollouts/s", "streaming ÷ static",
                 "occupancy static → streaming", "in-flight pause p50 / p99 (s)", "regenerated static / streaming"], rows)
    best = max(r.data["streaming_vs_static"], key=lambda p: p["streaming_over_static"])
    head = (f"{x(best['streaming_over_static'])} the static loop's rollouts/s, engine occupancy "
            f"{f(best['occupancy']['static'])} → {f(best['occupancy']['streaming'])} (k = {best['max_staleness']})")
    return note + "\n\n" + tbl, head


def hf_streaming(r: Result) -> tuple[str, str]:
    s, c = r.data["summary"], r.data.get("config", {})
    rows = [[mode, f(s[mode]["rollouts_per_s"]), f(s[mode]["tokens_per_s"], 1), f(s[mode]["occupancy"]),
             f(s[mode].get("occupancy_steady")), f(s[mode]["wall_s"], 1)] for mode in ("static", "streamed")]
    note = (f"{c.get('groups')} groups of {c.get('group_size')}, {c.get('slots')} slots, lengths lognormal "
            f"(median {c.get('length_median')}, up to {c.get('max_new_tokens')} tokens), {c.get('repeats')} repeat(s).")
    tbl = table(["mode", "rollouts/s", "tokens/s", "occupancy", "occupancy, steady", "wall (s)"], rows)
    return note + "\n\n" + tbl + f"\n\nStreamed ÷ static: {x(s['speedup'])}.", f"{x(s['speedup'])} static"


def trl_peer(r: Result) -> tuple[str, str]:
    text = r.data["table"].strip()
    text = "\n".join(line for line in text.splitlines() if not line.startswith("load average"))
    c = r.data["config"]
    note = (f"{c['prompts_per_step']} prompts × {c['generations']} generations a step, ≤ {c['max_new_tokens']} new "
            f"tokens, {c['steps']} steps ({c['warmup']} warm-up), {c['repeats']} repeat(s). Ratios are to TRL's better "
            "setting in the same repeat.")
    summary, best_trl = r.data["summary"], max((v["steady"] for k, v in r.data["summary"].items() if k.startswith("trl")),
                                               default=None)
    head = ""
    if best_trl:
        label = {"sync": "TRL's `GRPOTrainer` synchronously", "async1_b2": "at `max_staleness=1`"}
        parts = [f"{x(summary[m]['steady'] / best_trl)} {label[m]}" for m in label if m in summary]
        head = f"{' and '.join(parts)}, in steady-state rollouts/s" if parts else ""
    return note + "\n\n" + text.strip(), head


def chaos(r: Result) -> tuple[str, str]:
    fig, verdict = r.data["figures"], r.data["verdict"]
    keys = ["groups_expected", "groups_consumed", "groups_lost", "groups_consumed_twice",
            "rollout_versions_above_staleness_bound", "rollout_versions_ahead_of_trainer", "rollout_versions_dead_timeline",
            "forged_groups_consumed", "hangs", "leftover_processes", "worker_kills", "remote_kills", "trainer_kills",
            "save_kills", "hostile_messages", "forged_groups_sent", "incarnations"]
    rows = [[f"`{k}`", f(fig[k])] for k in keys if k in fig]
    checks = table(["check", "passed"], [[f"`{k}`", f(v)] for k, v in verdict.items()])
    head = (f"{fig['groups_lost']} lost, {fig['groups_consumed_twice']} twice over {fig['worker_kills'] + fig['remote_kills']}"
            f" worker kills, {fig['trainer_kills'] + fig['save_kills']} trainer kills, {fig['hostile_messages']:,} hostile "
            "messages")
    return table(["figure", "value"], rows) + "\n\n" + checks, head


def debugger_overhead(r: Result) -> tuple[str, str]:
    rows = [[f(int(n)), f(m["tokens"]), f(m["collate_ms"], 1), f(m["observe_ms"], 1), f(m["observe_with_dump_ms"], 1),
             x(m["observe_vs_collate"], 1), f(m["record_line_bytes"])] for n, m in r.data["metrics"].items()]
    last = list(r.data["metrics"].items())[-1]
    tbl = table(["rollouts", "tokens", "collate (ms)", "observe (ms)", "observe + dump (ms)", "observe ÷ collate",
                 "record line (bytes)"], rows)
    return tbl, f"{f(last[1]['observe_ms'], 0)} ms a step for {last[0]} rollouts"


def vllm_weight_apply(r: Result) -> tuple[str, str]:
    rows = [[f"`{k}`", f(v, 0), f(len(r.data["samples_s"][k]))] for k, v in r.data["median_ms"].items()]
    note = f"A {r.data['params']:,}-parameter model ({r.data['bytes'] / 1e6:,.0f} MB), full updates into vLLM on CPU."
    ratio = r.data["median_ms"]["rpc"] / r.data["median_ms"]["native"]
    return note + "\n\n" + table(["path", "median (ms)", "samples"], rows), f"native API {x(ratio, 1)} faster than the RPC"


def vllm_inflight_pause(r: Result) -> tuple[str, str]:
    rows = []
    for mode in ("keep", "abort", "idle"):
        for what in ("apply", "pause"):
            e = r.data[mode].get(what) or {}
            if e:
                rows.append([mode, what, f(e.get("n")), f(e["median_s"] * 1e3, 1), f(e["p99_s"] * 1e3, 1)])
    head = f"pause p50 {f(r.data['keep']['pause']['median_s'] * 1e3, 0)} ms (keep)"
    return table(["in flight", "what", "updates", "median (ms)", "p99 (ms)"], rows), head


def elastic_resume(r: Result) -> tuple[str, str]:
    metrics, ratios, c = r.data["metrics"], r.data["ratios"], r.data["config"]
    rows = []
    for case, m in metrics.items():
        saved, resumed = case.split("->")
        ratio = ratios.get(f"{case} / {resumed}->{resumed}", {})
        rows.append([f"{saved} → {resumed}", rng(m["resume_s"], 2), f(m["model_s"]), f(m["loader_s"]),
                     f(m["first_batch_s"], 3), x(ratio.get("resume_s")) if ratio else "baseline",
                     x(ratio.get("loader_s")) if ratio else ""])
    note = (f"{c['params']:,}-parameter model with its AdamW state, {c['prompts']:,} prompts, {c['buffered']} groups "
            f"of {c['group_size']} × {c['response_tokens']} response tokens in each saved rank's pool (half trained); "
            f"the slowest rank of each resume, medians over {c['repeats']} resumes.")
    tbl = table(["saved → resumed ranks", "resume (s), median (min–max)", "model + optimizer (s)", "loader (s)",
                 "first batch (s)", "resume ÷ same-size", "loader ÷ same-size"], rows)
    head = " and ".join(f"{name.split(' / ')[0].replace('->', '→')} {x(v['resume_s'])}" for name, v in ratios.items())
    return note + "\n\n" + tbl, f"{head} a same-size resume" if head else ""


def cluster_launch(r: Result) -> tuple[str, str]:
    m, c, ratios = r.data["metrics"], r.data["config"], r.data["ratios"]
    per_round = r.data.get("ratios_per_round", {})
    rows = [[name, f(run["rollouts_per_s"], 1), x(ratios.get(f"{name} / torchrun rollouts_per_s")) if name != "torchrun"
             else "baseline", " / ".join(x(v) for v in per_round.get(f"{name} / torchrun rollouts_per_s", [])) or "–",
             f"{run['steps'][0]}–{run['steps'][1]}", f(run["seconds"], 1), f(run["wall_s"], 1),
             str(run["staleness_max"])] for name, run in m.items()]
    add = m["ray"]["add_node"]
    ratio = ratios["ray / torchrun rollouts_per_s"]
    rounds = c.get("rounds", 1)
    note = (f"`{c['run_file']}`, {c['ranks']} trainer ranks, {c['workers']} HF workers, steps {c['warmup']} on "
            f"(start-up not counted), {rounds} round(s): the ratio is the median of the rounds' ratios, the other "
            f"columns are the median round's; load average before {f(r.data['load_average']['before'][0], 1)}.")
    tbl = table(["launcher", "rollouts/s", "÷ torchrun", "÷ torchrun, per round", "steps timed", "timed (s)",
                 "launch to end (s)", "staleness max"], rows)
    joined = table(["add_node → node seen (s)", "→ its worker started (s)", "→ its first group trained (s)"],
                   [[f(add["node_seen_s"], 1), f(add["worker_started_s"], 1), f(add["first_group_trained_s"], 1)]])
    head = f"Ray {x(ratio)} torchrun's rollouts/s; a joining node's first group trained {f(add['first_group_trained_s'], 1)} s after add_node"
    return note + "\n\n" + tbl + "\n\n" + joined, head


def recipe_learning(r: Result) -> tuple[str, str]:
    c = r.data["config"]
    rows = []
    for cand in r.data["candidates"]:
        runs = cand["runs"]
        rows.append([f"`{cand['overrides']}`" if cand["overrides"] else "(the run file)",
                     " / ".join(f"{run['reward_first']:.3f} → {run['reward_last']:.3f}" for run in runs),
                     f(cand["reward_change_mean"], 3), f(cand["reward_change_min"], 3),
                     " / ".join(f"{run['rejected']}/{run['steps']}" for run in runs),
                     " / ".join(str(run["exit_code"]) for run in runs)])
    window = r.data["candidates"][0]["runs"][0]["reward_window"]
    note = (f"`{c['run_file']}`, {c['nproc']} trainer rank(s), {c['runs']} runs a command (`train.seed` "
            f"{c.get('first_seed', 0)}…{c.get('first_seed', 0) + c['runs'] - 1}); reward averaged over the first and "
            f"the last {window} steps.")
    tbl = table(["overrides", "reward first → last, per run", "change, mean", "change, min", "rejected updates",
                 "exit status"], rows)
    best = max(r.data["candidates"][1:] or r.data["candidates"],
               key=lambda cand: (cand["reward_change_min"] > 0, -cand["rejected_fraction_mean"], cand["reward_change_mean"]))
    head = (f"`{best['overrides']}`: reward {best['reward_change_mean']:+.3f} on average, "
            f"{f(best['rejected_fraction_mean'] * 100, 0)}% of updates rejected")
    return note + "\n\n" + tbl, head


# -- the registry -------------------------------------------------------------------------------------------------------
def _before_after(trees: dict[str, Any], get: Callable[[dict[str, Any]], Any], fmt: Callable[[Any], str]) -> str:
    """``before → after`` of one figure over the baseline and current trees (``after`` alone without a baseline)."""
    def one(name: str) -> str:
        try:
            return fmt(get(trees[name]))
        except (KeyError, TypeError):
            return "–"

    return f"{one('baseline')} → {one('current')}" if "baseline" in trees else one("current")


def control_plane(r: Result) -> tuple[str, str]:
    trees, c = r.data["trees"], r.data["config"]
    cur = trees["current"]
    sizes = list(cur.get("paced") or cur.get("window") or {})

    def served(n: str, phase: str = "window") -> Callable[[dict[str, Any]], str]:
        return lambda t: "{served}/{workers}".format(**t[phase][n]["groups_per_worker"])

    rows = [[n,
             _before_after(trees, served(n), str),
             _before_after(trees, lambda t, n=n: t["window"][n]["pool_cpu_s_per_1k_groups"], f),
             _before_after(trees, lambda t, n=n: t["paced"][n]["pool_cpu_s_per_1k_groups"], f),
             _before_after(trees, lambda t, n=n: t["paced"][n]["credit_wait_ms"]["p50"], lambda v: f(v, 1)),
             _before_after(trees, lambda t, n=n: t["paced"][n]["credit_wait_ms"]["p99"], lambda v: f(v, 1))]
            for n in sizes]
    before = "before → after: " if "baseline" in trees else ""
    note = (f"Simulated workers (`asyncrl.testing.swarm.Swarm`, real DEALER sockets), {c['seconds']:g} s windows, "
            f"heartbeat {c['heartbeat_s']:g} s. *window*: `max_staleness=1`, `batch_size=8` (16 groups in flight), "
            f"8 slots a worker, an engine that costs nothing. *paced*: {c['paced_rate']:g} groups/s offered whatever "
            "the number of workers (streaming, 2 slots each); the credit round trip is from a group sent to the next "
            "lease received, as the worker sees it." + (f" Each cell is {before}the baseline `{trees['baseline']['ref']}` "
                                                         "→ this tree, in the same run." if before else ""))
    main = table(["workers", "window: workers served", "window: pool CPU-s / 1k groups", "paced: pool CPU-s / 1k groups",
                  "credit round trip p50 (ms)", "p99 (ms)"], rows)
    parts = [note, main]
    if "idle" in cur:
        share = lambda key: lambda t: t["idle"][key] if key != "worker" else t["idle"]["worker"]["core_share"]
        pct = lambda v: f(100 * v, 2, " %")
        parts.append(table(["idle", "share of one core"], [
            [f"the pool process, {cur['idle']['workers']} workers connected", _before_after(trees, share("pool_core_share"), pct)],
            ["one worker process (`asyncrl worker`, fake engine)", _before_after(trees, share("worker"), pct)]]))
    if "scaling" in cur:
        parts.append(f"Rollouts/s against workers, an engine call of {c['service_s']:g} s (±50 %), 8 slots, 4 leases a "
                     f"call, a window of {2 * c['scaling_batch_size']} groups (binds from "
                     f"{2 * c['scaling_batch_size'] // 4} workers):")
        parts.append(table(["workers", "rollouts/s", "workers served"], [
            [n, _before_after(trees, lambda t, n=n: t["scaling"][n]["rollouts_per_s"], lambda v: f(v, 0)),
             _before_after(trees, served(n, "scaling"), str)]
            for n in cur["scaling"]]))
    verdict = cur.get("verdict", {})
    parts.append(table(["target (this tree)", "value", "met"], [
        [f"`{k}`", f(v.get("value"), 4), f(v.get("met"))] for k, v in verdict.items()]))
    big = sizes[-1] if sizes else None
    head = ""
    if big and "window" in cur:
        head = f"every worker served at {big} workers ({_before_after(trees, served(big), str)})"
        if "idle" in cur:
            head += f", idle pool {f(100 * cur['idle']['pool_core_share'], 2, ' %')} of a core"
    return "\n\n".join(parts), head


def _is(bench: str, **cond: Any) -> Callable[[Result], bool]:
    def pred(r: Result) -> bool:
        if r.data.get("benchmark") != bench or r.gpu != cond.get("gpu", False):
            return False
        c = r.data.get("config") or {}
        if "mode" in cond and r.data.get("mode") != cond["mode"]:
            return False
        if "regime" in cond and c.get("regime") != cond["regime"]:
            return False
        if "calibrated" in cond and bool(c.get("calibrate")) != cond["calibrated"]:
            return False
        if "has" in cond and cond["has"] not in r.data:
            return False
        if "engine" in cond and bool(c.get("engine")) != cond["engine"]:
            return False
        return True

    return pred


@dataclass(slots=True)
class Series:
    title: str
    select: Callable[[Result], bool]
    render: Callable[[Result], tuple[str, str]]


@dataclass(slots=True)
class Benchmark:
    page: str
    """Page under docs/benchmarks/ (without .md)."""
    title: str
    script: str
    measures: str
    command: str
    series: list[Series] = field(default_factory=list)


BENCHMARKS = [
    Benchmark("data_plane", "Data plane", "benchmarks/data_plane.py",
              "rollouts/s into a training loop: `RolloutLoader` against `multiprocessing.Queue`, a Ray actor queue and raw ZeroMQ",
              "python -m benchmarks.data_plane",
              [Series("Rollouts/s into one consumer", _is("data_plane"), data_plane)]),
    Benchmark("weight_sync", "Weight sync", "benchmarks/weight_sync.py",
              "publish → verified in every receiver's engine, per backend and receiver count, against memcpy and raw pyzmq",
              "python -m benchmarks.weight_sync",
              [Series("End-to-end weight sync", _is("weight_sync"), weight_sync)]),
    Benchmark("weight_delta", "Delta updates", "benchmarks/weight_delta.py",
              "bytes and time of a delta update (`weights.delta`) against a full one",
              "python -m benchmarks.weight_delta",
              [Series("Full model", _is("weight_delta", has="zmq"), weight_delta),
               Series("LoRA adapter", _is("weight_delta", has="lora"), weight_delta_lora)]),
    Benchmark("weight_fanout", "Weight fan-out", "benchmarks/weight_fanout.py",
              "broadcaster bytes per update and time until every worker holds it, per node count, with and without a "
              "per-node relay",
              "python -m benchmarks.weight_fanout",
              [Series("Per-node relay against direct", _is("weight_fanout"), weight_fanout)]),
    Benchmark("freshness", "Freshness vs throughput", "benchmarks/freshness.py",
              "trained rollouts/s, idle time and staleness per `max_staleness` and worker count, against min(G, T)",
              "python -m benchmarks.freshness measured --staleness 0,1,2,4 --workers 1,2",
              [Series("Measured", _is("freshness", mode="measured", regime=None), freshness_measured),
               Series("Simulated, calibrated from a measured run",
                      _is("freshness", mode="simulated", regime=None, calibrated=True), freshness_simulated),
               Series("Simulated, a 7B-sized long tail", _is("freshness", mode="simulated", regime=None, calibrated=False),
                      freshness_simulated)]),
    Benchmark("streaming", "Streaming vs static workers", "benchmarks/freshness.py --regime long-tail",
              "streaming workers against static batches on a long-tailed workload: rollouts/s and engine occupancy",
              "python -m benchmarks.freshness measured --regime long-tail --engine hf",
              [Series("Measured (the recipe)", _is("freshness", mode="measured", regime="long-tail"), streaming),
               Series("Simulated", _is("freshness", mode="simulated", regime="long-tail"), streaming)]),
    Benchmark("hf_streaming", "HF engine: streamed vs static", "benchmarks/hf_streaming.py",
              "the HF engine alone: static `generate` against continuous batching on a long tail",
              "python -m benchmarks.hf_streaming",
              [Series("Streamed vs static", _is("hf_streaming"), hf_streaming)]),
    Benchmark("trl_peer", "Against TRL", "benchmarks/trl_peer.py",
              "the recipe against TRL's `GRPOTrainer` on the same model and workload: steady-state and end-to-end rollouts/s",
              "python benchmarks/trl_peer.py",
              [Series("Recipe vs TRL", _is("trl_peer", engine=False), trl_peer)]),
    Benchmark("chaos", "Chaos", "benchmarks/chaos.py",
              "the guarantees under SIGKILLs of workers and trainer (inside saves too) and a rogue peer",
              "python -m benchmarks.chaos",
              [Series("Accounting", _is("chaos"), chaos)]),
    Benchmark("elastic_resume", "Elastic resume", "benchmarks/elastic_resume.py",
              "a resume at another number of trainer ranks (2 → 1, 1 → 2) against a resume at the same number",
              "python -m benchmarks.elastic_resume",
              [Series("Resume time", _is("elastic_resume"), elastic_resume)]),
    Benchmark("cluster_launch", "torchrun vs Ray", "benchmarks/cluster_launch.py",
              "the same tiny run launched by torchrun and by Ray (fake nodes on one machine): rollouts/s, and the "
              "seconds from `add_node` to the first group from the new node",
              "python -m benchmarks.cluster_launch",
              [Series("Launchers and a joining node", _is("cluster_launch"), cluster_launch)]),
    Benchmark("control_plane", "Control plane at scale", "benchmarks/control_plane.py",
              "one pool fed by 8 to 256 simulated workers: who gets leases, pool CPU per group, the credit round trip, "
              "idle costs; before and after in one run",
              "python -m benchmarks.control_plane --baseline-ref main",
              [Series("Before and after", _is("control_plane"), control_plane)]),
    Benchmark("debugger_overhead", "Debugger cost", "benchmarks/debugger_overhead.py",
              "the RL debugger's per-step cost against a collate of the same batch",
              "python -m benchmarks.debugger_overhead",
              [Series("Per step", _is("debugger_overhead"), debugger_overhead)]),
    Benchmark("vllm_weight_apply", "vLLM: applying a full update", "benchmarks/vllm_weight_apply.py",
              "a full update into vLLM through its weight-transfer API against the safetensors-bytes RPC",
              "python -m benchmarks.vllm_weight_apply",
              [Series("Apply time", _is("vllm_weight_apply"), vllm_weight_apply)]),
    Benchmark("vllm_inflight_pause", "vLLM: the in-flight pause", "benchmarks/vllm_inflight_pause.py",
              "how long an update pauses vLLM's in-flight requests (keep, abort, idle)",
              "python -m benchmarks.vllm_inflight_pause",
              [Series("Pause per update", _is("vllm_inflight_pause"), vllm_inflight_pause)]),
    Benchmark("recipe_learning", "Does a recipe command learn?", "benchmarks/recipe_learning.py",
              "reward over the first and the last window of a recipe command's run, and the guard's verdicts, over a few "
              "seeds, against a baseline command",
              "python -m benchmarks.recipe_learning --runs 3 --candidate '' --candidate 'lora.rank=8 train.lr=0.003'",
              [Series("Reward first vs last window", _is("recipe_learning"), recipe_learning)]),
    Benchmark("gpu", "GPU checks", "benchmarks/gpu_checks.sh",
              "the GPU checks in one run: unit tests with CUDA, the recipe on a GPU, data plane and weight sync on a GPU host",
              "bash benchmarks/gpu_checks.sh",
              [Series("Data plane on a GPU host", _is("data_plane", gpu=True), data_plane),
               Series("Weight sync on a GPU host", _is("weight_sync", gpu=True), weight_sync)]),
]

HEADLINES = (("data_plane", "data plane"), ("trl_peer", "against TRL"), ("streaming", "streaming workers"))
"""The three numbers of README.md: (benchmark page, label)."""


def newest(results: list[Result], series: Series) -> Result | None:
    matching = [r for r in results if series.select(r)]
    return max(matching, key=lambda r: (r.when, r.rel)) if matching else None


def _block(bench: Benchmark, results: list[Result]) -> tuple[str, str, str]:
    """(generated block of the page, headline, JSON of the first series) for one benchmark."""
    parts, headline, first = [], "", ""
    for s in bench.series:
        r = newest(results, s)
        parts += [f"### {s.title}", ""]
        if r is None:
            parts += ["No result file yet.", ""]
            continue
        tbl, head = s.render(r)
        headline, first = headline or head, first or r.rel
        parts += [f"From `{r.rel}` ({r.machine()}), the newest of {sum(map(s.select, results))} such result file(s).",
                  "", tbl, ""]
    return "\n".join(parts), headline, first


def render(results: list[Result] | None = None) -> dict[Path, str]:
    results = load_results() if results is None else results
    out: dict[Path, str] = {}
    index_rows, heads = [], {}
    for bench in BENCHMARKS:
        page = PAGES / f"{bench.page}.md"
        block, head, first = _block(bench, results)
        text = page.read_text() if page.exists() else f"# {bench.title}\n\n{BEGIN_END(bench.page)}\n"
        out[page] = replace_block(text, "results", block)
        heads[bench.page] = head
        json_link = f"[{Path(first).name}]({Path(first).relative_to('benchmarks')})" if first else "–"
        index_rows.append([f"[`{bench.script}`]({bench.script.split()[0].removeprefix('benchmarks/')})", bench.measures,
                           f"`{bench.command}`", f"{head} ([page](../docs/benchmarks/{bench.page}.md))" if head else
                           f"[page](../docs/benchmarks/{bench.page}.md)", json_link])
    out[INDEX] = replace_block(INDEX.read_text(), "index",
                               table(["script", "measures", "command", "latest result", "JSON"], index_rows))
    lines = [f"- **{label}**: {heads[page]} ([{page}](docs/benchmarks/{page}.md))" for page, label in HEADLINES]
    out[README] = replace_block(README.read_text(), "headlines", "\n".join(lines))
    return out


def BEGIN_END(name: str) -> str:
    from docs._gen._text import BEGIN, END

    return f"{BEGIN.format(name='results')}\n{END.format(name='results')}"


if __name__ == "__main__":
    for path, text in render().items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path.relative_to(ROOT)}", file=sys.stderr)

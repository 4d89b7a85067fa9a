"""Weight sync end to end: publish -> every receiver's engine tensors hold the version, against memcpy and raw pyzmq.

Payload: random bf16 tensors shaped like a Llama-style model (hidden 2048, intermediate 8192, 32/8 heads;
as many layers as the size needs, then the embedding), ``--sizes`` GB each (1 GB = 1e9 B). Paths, all in
one run, each measured at every size and receiver count:

  memcpy     torch ``copy_`` of the payload into one preallocated, already touched buffer (``--threads``
             threads): one warm copy, the floor any path pays at least once.
  raw_zmq    the same bytes as zero-copy pyzmq frames (one multipart message per version, PUSH -> PULL per
             receiver over tcp loopback, default context) and each receiver copies them into its engine
             tensors: what the zmq backend's link can do with no protocol, no checksum, no two-phase commit.
  shm, zmq   the asyncrl backends (default bucket size): ``publish()`` in this process; each receiver process
             ``wait()``s for the version, copies every staged tensor into its engine tensors
             (``param.copy_(view)``, what the HF engine's load does) and commits.
  shm-shadow the shm backend with the engine's shadow weights (``weights.shadow``,
             ``asyncrl.weights.shadow``): the receiver copies each bucket into the engine's private shadow as
             soon as it is published, the verification fused into that copy, while the broadcaster writes the
             next; the engine then swaps shadow and live storage (``tensor.data``, what the HF engine's apply
             does) and commits. A private engine copy, with no copy after the transfer.
  shm-views  the shm backend, the engine running from the verified read-only views (no private copy).

End to end is from the start of ``publish()`` (or of the raw send) to the last receiver's "engine holds it"
(``CLOCK_MONOTONIC``, shared by the processes of a machine). Every byte is verified: the backends check every
bucket's xxh3-64 before staging; every receiver checks a per-version stamp in each engine tensor and, once
per case, an xxh3 of all its engine tensors against the payload's (outside the timed path). Ratios are to
memcpy and to raw pyzmq of the same size measured in the same run (``x_memcpy``, ``x_raw_zmq``; targets
shm >= 0.6x memcpy, zmq >= 0.5x raw pyzmq).

Memory: a case needs ``payload + path footprint`` (shm: 2 slots + N engines, shadow 2 slots + 2N; zmq: one snapshot + N x (receive
buffers + engine); raw_zmq: N x (libzmq's copy + engine)). A case over ``--mem-budget-gb`` (payload included;
default 80 % of MemAvailable at start) runs with ``engine="views"`` where the backend allows it (shm: each receiver's
engine keeps the verified, read-only views into the shared slots, as an engine that runs from shared memory
would; no private copy, so N receivers need no N x S), else is skipped and listed with its footprint. On the
24 GiB machine, 4 GB x 4 receivers runs shm with views (12 GB: payload + 2 slots), and zmq / raw_zmq at
4 GB only with 1 receiver (16 / 12 GB).

    .venv/bin/python -m benchmarks.weight_sync [--sizes 1,4] [--receivers 1,2,4] [--backends shm,zmq] [--repeats 3]
    .venv/bin/python -m benchmarks.weight_sync --sizes 0.25 --receivers 1 --repeats 2       # quick
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing as mp
import os
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import xxhash

from benchmarks._report import git_commit, machine

GB = 1e9
RESULTS_DIR = Path(__file__).resolve().parent / "results"
SHAPES = dict(hidden=2048, intermediate=8192, heads=32, kv_heads=8, head_dim=64, vocab=128256)
REPORT_TIMEOUT_S = 600.0
PATHS = ("raw_zmq", "shm", "zmq")
ENGINE_MODES = ("copy", "shadow", "views")


# -- payload -------------------------------------------------------------------------------------
def model_shapes(target_bytes: float) -> list[tuple[str, list[int]]]:
    """(name, shape) of bf16 layers of the Llama-style model until ``target_bytes``, then as much embedding as fits."""
    c = SHAPES
    h, i, q, kv = c["hidden"], c["intermediate"], c["heads"] * c["head_dim"], c["kv_heads"] * c["head_dim"]
    layer = [("self_attn.q_proj", [q, h]), ("self_attn.k_proj", [kv, h]), ("self_attn.v_proj", [kv, h]),
             ("self_attn.o_proj", [h, q]), ("mlp.gate_proj", [i, h]), ("mlp.up_proj", [i, h]),
             ("mlp.down_proj", [h, i]), ("input_layernorm", [h]), ("post_attention_layernorm", [h])]
    out, total, n = [], 0, 0
    while True:
        block = [(f"model.layers.{n}.{p}.weight", s) for p, s in layer]
        size = sum(2 * _numel(s) for _, s in block)
        if total + size > target_bytes:
            break
        out += block
        total, n = total + size, n + 1
    rows = int((target_bytes - total) // (2 * h))
    if rows > 0:
        out.append(("model.embed_tokens.weight", [min(rows, c["vocab"] * 8), h]))
    return out


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def make_payload(shapes: list[tuple[str, list[int]]], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)  # random bit patterns: nothing compresses or dedups
    return {name: torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=g).view(torch.bfloat16)
            for name, shape in shapes}


def stamp(tensors: dict[str, torch.Tensor], version: int) -> None:
    """Marks every tensor with the version (its first element), so a receiver can tell versions apart."""
    for t in tensors.values():
        t.view(torch.int16).view(-1)[0] = version


def digest(tensors: dict[str, torch.Tensor]) -> int:
    h = xxhash.xxh3_64()
    for name, t in tensors.items():
        h.update(name.encode())
        h.update(memoryview(t.contiguous().view(torch.uint8).view(-1).numpy()))
    return h.intdigest()


# -- receiver processes --------------------------------------------------------------------------
def receiver_main(path: str, address: str, receiver_id: str, shapes: list, engine_mode: str, threads: int,
                  conn: Any) -> None:
    """A worker's side: its engine tensors, preallocated and touched; each version is copied into them."""
    torch.set_num_threads(threads)
    engine = {name: torch.zeros(shape, dtype=torch.bfloat16) for name, shape in shapes}
    if path == "raw_zmq":
        return _raw_receiver(address, engine, conn)
    from asyncrl.weights import setup_weight_receiver
    from asyncrl.weights.shadow import ShadowWeights

    r = setup_weight_receiver(path, address, receiver_id=receiver_id)
    shadow = ShadowWeights(engine) if engine_mode == "shadow" else None  # pre-faulted, like the engine tensors
    if shadow is not None:
        r.attach_shadow(shadow)
    r.start()
    conn.send({"event": "ready"})
    last, checked = 0, False
    while not conn.poll():
        update = r.wait(last + 1, 0.2)
        if update is None:
            continue
        via_shadow = shadow is not None and shadow.holds(update)
        if via_shadow:  # the engine's commit: swap live and shadow storage, O(1) per tensor
            shadow.swap_into(engine, update)
            held = engine
        elif engine_mode in ("copy", "shadow"):  # shadow: a version the shadow could not take (busy) is copied
            for name, t in update.tensors.items():
                engine[name].copy_(t)
            held = engine
        else:  # "views": the engine runs from the verified shared-memory views
            held = update.tensors
        done = time.monotonic()
        stamped = all(int(t.view(torch.int16).view(-1)[0]) == update.version for t in held.values())
        report = {"event": "applied", "version": update.version, "done_at": done, "stamped": stamped,
                  "staged_at": update.metadata["staged_at"], "transfer_s": update.metadata["transfer_s"],
                  "via_shadow": via_shadow}
        if not checked:
            report["digest"], checked = digest(held), True
        last = update.version
        r.commit(last)
        conn.send(report)
    stats = r.stats()
    r.close()
    conn.send({"event": "stopped", "failures": stats["failures"], "recent_failures": stats["recent_failures"],
               "peak_rss_gb": peak_rss_gb()})


def _raw_receiver(address: str, engine: dict[str, torch.Tensor], conn: Any) -> None:
    import ctypes

    import numpy as np
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    conn.send({"event": "ready"})
    checked = False
    targets = list(engine.values())
    while not conn.poll():
        if not sock.poll(200):
            continue
        frames = sock.recv_multipart(copy=False)
        version = int.from_bytes(frames[0].bytes, "little")
        for t, f in zip(targets, frames[1:]):
            ctypes.memmove(t.data_ptr(), np.frombuffer(f.buffer, dtype=np.uint8).ctypes.data, t.nbytes)
        done = time.monotonic()
        del frames
        stamped = all(int(t.view(torch.int16).view(-1)[0]) == version for t in targets)
        report = {"event": "applied", "version": version, "done_at": done, "stamped": stamped}
        if not checked:
            report["digest"], checked = digest(engine), True
        conn.send(report)
    sock.close()
    ctx.term()
    conn.send({"event": "stopped", "failures": 0, "recent_failures": [], "peak_rss_gb": peak_rss_gb()})


def peak_rss_gb() -> float | None:
    """This process's peak resident memory (VmHWM)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / GB
    except OSError:
        pass
    return None


class Receivers:
    """N receiver processes of one path, each reporting over a pipe."""

    def __init__(self, path: str, addresses: list[str], shapes: list, engine_mode: str, threads: int):
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for i, address in enumerate(addresses):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=receiver_main, args=(path, address, f"r{i}", shapes, engine_mode, threads, child),
                               daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        for c in self.conns:
            assert self.recv(c)["event"] == "ready"

    def recv(self, conn: Any) -> dict[str, Any]:
        if not conn.poll(REPORT_TIMEOUT_S):
            raise TimeoutError(f"no report from a receiver within {REPORT_TIMEOUT_S} s")
        return conn.recv()

    def applied(self, version: int) -> list[dict[str, Any]]:
        out = []
        for c in self.conns:
            while (report := self.recv(c))["version"] < version:
                pass
            out.append(report)
        return out

    def stop(self) -> list[dict[str, Any]]:
        out = []
        for c in self.conns:
            c.send("stop")
        for c, p in zip(self.conns, self.procs):
            while (report := self.recv(c))["event"] != "stopped":
                pass
            out.append(report)
            p.join(30)
        return out


# -- cases ---------------------------------------------------------------------------------------
def footprint(path: str, size: float, n: int, engine_mode: str) -> float:
    """Bytes a case needs beyond the payload (see the module docstring)."""
    engines = {"copy": n * size, "shadow": 2 * n * size}.get(engine_mode, 0)
    return {"shm": 2 * size + engines, "zmq": size + n * size + engines, "raw_zmq": n * size + engines}[path]


def run_case(path: str, n: int, payload: dict[str, torch.Tensor], shapes: list, engine_mode: str,
             args: argparse.Namespace, version0: int) -> dict[str, Any]:
    nbytes = sum(t.nbytes for t in payload.values())
    want = None
    if path == "raw_zmq":
        import zmq

        ctx = zmq.Context()
        socks = [ctx.socket(zmq.PUSH) for _ in range(n)]
        addresses = []
        for s in socks:
            s.setsockopt(zmq.LINGER, 0)
            addresses.append(f"tcp://127.0.0.1:{s.bind_to_random_port('tcp://127.0.0.1')}")
        frames = [memoryview(t.view(torch.uint8).view(-1).numpy()) for t in payload.values()]
    else:
        from asyncrl.weights import setup_weight_broadcaster

        # shm: wait for a slot rather than replace it. A receiver still hashing its engine tensors (the untimed
        # digest of the first version: seconds at 4 GB with 4 receivers on 2 cores) holds its slot past the default
        # slot_wait_s; a replaced slot is a fresh segment of the version's size while the old one stays mapped,
        # the likely cause of the OOM at 4 GB x 4 (2026-12-01). Replacements are reported per case.
        kw = {"keep_versions": 1} if path == "zmq" else {"slot_wait_s": REPORT_TIMEOUT_S}
        b = setup_weight_broadcaster(path, bucket_bytes=args.bucket_mb << 20, **kw)
        addresses = [b.address] * n
    receivers = Receivers(path, addresses, shapes, engine_mode, args.threads)
    samples, digests, broadcaster_stats = [], [], {}
    try:
        for k in range(args.repeats + 1):  # version 0 of a case warms it up (segments, buffers, mappings)
            version = version0 + k + 1
            stamp(payload, version)
            if k == 0:
                want = digest(payload)
            time.sleep(random.uniform(0, 0.025))  # decorrelate from the receivers' poll phase
            t0 = time.monotonic()
            if path == "raw_zmq":
                for s in socks:
                    s.send_multipart([version.to_bytes(8, "little"), *frames], copy=False)
                publish_s = time.monotonic() - t0
            else:
                publish_s = b.publish(payload, version)["publish_s"]
            reports = receivers.applied(version)
            latency = max(r["done_at"] for r in reports) - t0
            if not all(r["stamped"] and r["version"] == version for r in reports):
                raise AssertionError(f"{path} x{n}: a receiver's engine does not hold version {version}: {reports}")
            digests += [r["digest"] for r in reports if "digest" in r]
            sample = {"latency_s": latency, "publish_s": publish_s,
                      "staged_s": [r["staged_at"] - t0 for r in reports if "staged_at" in r]}
            sample["via_shadow"] = sum(bool(r.get("via_shadow")) for r in reports)
            if k == 0:
                first = sample
            else:
                samples.append(sample)
    finally:
        stopped = receivers.stop()
        if path == "raw_zmq":
            for s in socks:
                s.close(linger=0)
            ctx.term()
        else:
            broadcaster_stats = b.stats()
            b.close()
    if any(d != want for d in digests):
        raise AssertionError(f"{path} x{n}: engine tensors differ from the payload ({digests} vs {want})")
    lat = [s["latency_s"] for s in samples]
    staged = [max(s["staged_s"]) for s in samples if s["staged_s"]]
    return {"bytes": nbytes, "receivers": n, "engine": engine_mode, "verified": len(digests) == n,
            "latency_s": stats_of(lat), "gb_per_s": stats_of([nbytes / x / GB for x in lat]),
            "staged_gb_per_s": stats_of([nbytes / x / GB for x in staged]) if staged else None,
            "first_version": first,
            "publish_s": stats_of([s["publish_s"] for s in samples]), "samples": samples,
            "via_shadow": sum(s["via_shadow"] for s in samples),
            "receiver_reports": stopped, "loadavg_1m": os.getloadavg()[0],
            "slots_replaced": broadcaster_stats.get("slots_replaced", 0) if path != "raw_zmq" else None}


def memcpy_case(payload: dict[str, torch.Tensor], repeats: int) -> dict[str, Any]:
    nbytes = sum(t.nbytes for t in payload.values())
    dst = torch.zeros(nbytes, dtype=torch.uint8)  # touched: the warm path measures copying only
    seconds = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        offset = 0
        for t in payload.values():
            dst[offset : offset + t.nbytes].view(t.dtype).view(t.shape).copy_(t)
            offset += t.nbytes
        seconds.append(time.perf_counter() - t0)
    seconds = seconds[1:]  # the first pass warms the source's cache lines and TLB like later ones
    return {"bytes": nbytes, "latency_s": stats_of(seconds), "gb_per_s": stats_of([nbytes / s / GB for s in seconds])}


def stats_of(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def mem_available() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1,4", help="comma-separated version sizes, GB (1e9 B)")
    p.add_argument("--receivers", default="1,2,4", help="comma-separated receiver process counts")
    p.add_argument("--backends", default="shm,zmq", help="comma-separated subset of shm,zmq (raw_zmq always runs)")
    p.add_argument("--repeats", type=int, default=3, help="versions published per case")
    p.add_argument("--threads", type=int, default=1, help="torch threads in every process")
    p.add_argument("--engines", default="copy,shadow,views",
                   help="shm engine modes: copy (param.copy_(view) into private tensors), shadow (the receiver fills the "
                        "engine's shadow weights, swapped in at commit), views (run from the views)")
    p.add_argument("--bucket-mb", type=int, default=64, help="bucket size of the backends, MiB")
    p.add_argument("--mem-budget-gb", type=float, default=None,
                   help="memory a case may use, payload included; default 80%% of MemAvailable at start")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON path (default benchmarks/results/weight_sync-DATE.json)")
    args = p.parse_args(argv)
    args.sizes = [float(s) for s in args.sizes.split(",") if s]
    args.receivers = [int(s) for s in args.receivers.split(",") if s]
    args.backends = [s for s in args.backends.split(",") if s]
    args.engines = [s for s in args.engines.split(",") if s]
    if set(args.engines) - set(ENGINE_MODES):
        p.error(f"--engines must be a subset of {','.join(ENGINE_MODES)}, got {args.engines}")
    if set(args.backends) - {"zmq", "shm"} or not args.receivers or min(args.receivers) < 1 or not args.sizes:
        p.error(f"--backends must be a subset of shm,zmq, --receivers positive ints, --sizes given; "
                f"got {args.backends} {args.receivers} {args.sizes}")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    date = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    budget = args.mem_budget_gb * GB if args.mem_budget_gb is not None else 0.8 * mem_available()
    results: dict[str, Any] = {}
    skipped: list[dict[str, Any]] = []
    version = 0
    for size_gb in args.sizes:
        shapes = model_shapes(size_gb * GB)
        payload = make_payload(shapes, seed=int(size_gb * 1000))
        nbytes = sum(t.nbytes for t in payload.values())
        key = f"{nbytes / GB:.3g}GB"
        row: dict[str, Any] = {"bytes": nbytes, "tensors": len(shapes), "memcpy": memcpy_case(payload, args.repeats)}
        print(f"{key}: memcpy {row['memcpy']['gb_per_s']['median']:.2f} GB/s", flush=True)
        for n in args.receivers:
            for path in ["raw_zmq", *args.backends]:
                # the payload stays resident beside every case; shm runs each of --engines that fits (views if none)
                wanted = [m for m in ENGINE_MODES if m in args.engines] if path == "shm" else ["copy"]
                modes = [m for m in wanted if nbytes + footprint(path, nbytes, n, m) <= budget]
                if not modes and path == "shm" and nbytes + footprint(path, nbytes, n, "views") <= budget:
                    modes = ["views"]
                for m in wanted:
                    if m not in modes:
                        need = (nbytes + footprint(path, nbytes, n, m)) / GB
                        skipped.append({"size": key, "path": path, "engine": m, "receivers": n,
                                        "budget_gb": budget / GB, "footprint_gb": need})
                        print(f"  {path} ({m}) x{n}: skipped (needs {need:.1f} GB, budget {budget / GB:.1f} GB)",
                              flush=True)
                for m in modes:
                    out = run_case(path, n, payload, shapes, m, args, version)
                    version += args.repeats + 1
                    memcpy = row["memcpy"]["gb_per_s"]["median"]
                    out["x_memcpy"] = out["gb_per_s"]["median"] / memcpy
                    if out["staged_gb_per_s"] is not None:
                        out["x_memcpy_staged"] = out["staged_gb_per_s"]["median"] / memcpy
                    raw = row.get(f"raw_zmq x{n}")
                    if raw is not None:
                        out["x_raw_zmq"] = out["gb_per_s"]["median"] / raw["gb_per_s"]["median"]
                    name = f"{path} x{n}" if m == "copy" or path != "shm" else f"shm-{m} x{n}"
                    row[name] = out
                    print(f"  {name} ({m}): {out['gb_per_s']['median']:.2f} GB/s end to end, "
                          f"{out['x_memcpy']:.2f}x memcpy" + (f", {out['x_raw_zmq']:.2f}x raw pyzmq" if raw else "")
                          + (f", staged {out['x_memcpy_staged']:.2f}x memcpy" if "x_memcpy_staged" in out else "")
                          + f", latency {out['latency_s']['median'] * 1e3:.0f} ms"
                          + (f", {out['via_shadow']}/{n * args.repeats} via the shadow" if m == "shadow" else ""),
                          flush=True)
        results[key] = row
        del payload
    config = {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "gb": GB,
              "shapes": SHAPES, "mem_budget_gb": budget / GB}
    report = {"benchmark": "weight_sync", "date": date, "commit": git_commit(), "config": config,
              "machine": machine(), "results": results, "skipped": skipped,
              "broadcaster_peak_rss_gb": peak_rss_gb()}
    path = args.out or RESULTS_DIR / f"weight_sync-{date[:10]}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, path)
    print_table(report)
    print(f"wrote {path}")


def print_table(report: dict[str, Any]) -> None:
    print("\nend to end (publish -> engine tensors hold it, verified): GB/s median, ratio")
    for size, row in report["results"].items():
        print(f"{size}: memcpy {row['memcpy']['gb_per_s']['median']:.2f} GB/s")
        for name, m in row.items():
            if isinstance(m, dict) and "receivers" in m:
                ratios = f"{m['x_memcpy']:.2f}x memcpy" + (f", {m['x_raw_zmq']:.2f}x raw" if "x_raw_zmq" in m else "")
                ratios += f" (staged: {m['x_memcpy_staged']:.2f}x memcpy)" if "x_memcpy_staged" in m else ""
                print(f"  {name:<14} {m['engine']:<6} {m['gb_per_s']['median']:>7.2f} GB/s  {ratios}")


if __name__ == "__main__":
    main()

"""Weight sync: latency and bandwidth of publish -> every receiver staged, per backend, against memcpy.

Payload: random tensors shaped like a transformer. ``tiny`` is the tiny Qwen2 test model's state dict
(fp32, ~0.36 MB); the other sizes are the largest prefix (in model order: layers, final norm, then the
embedding) of a ~1.2B-parameter Llama-style model in bf16 (hidden 2048, intermediate 8192, 32/8
heads, 16 layers, vocab 128256) that fits the size: ~64 MB, ~256 MB, ~1 GB, ~2 GB (16 layers, 0.97B
parameters, 1.95 GB), capped by ``--max-gb``. 1 GB = 1e9 B. Paths, all in this one run:

  memcpy        torch ``copy_`` of the tensors into one preallocated, already touched buffer: the
                cost of one copy, the floor of any snapshot.
  memcpy_fresh  ``clone()`` of every tensor (fresh allocation, page faults included): what a
                receiver pays at least to own a copy.
  zmq xN        ``ZmqWeightBroadcaster`` in this process (``keep_versions=1``) and N
                ``ZmqWeightReceiver`` processes (tcp loopback, default window and bucket size).
  shm xN        ``ShmWeightBroadcaster`` (files in /dev/shm) and N ``ShmWeightReceiver`` processes.

Latency is from the start of ``publish()`` (snapshot + crc32 included) to the last receiver's
``staged_at`` (every bucket received, copied into receiver-owned memory and crc32-verified);
``CLOCK_MONOTONIC`` is shared by all processes on a machine. GB/s = version bytes / latency (per
receiver; with 2 receivers twice the bytes cross); ``transfer_gb_per_s`` leaves out the publish
(bytes / the slowest receiver's manifest-to-staged time). The LoRA rows publish rank-16 adapters (bf16,
``lora_A`` [16, in] and ``lora_B`` [out, 16] for q/k/v/o/gate/up/down) of the same layers in
``mode="lora"``. Each publish starts after a random 0-25 ms pause, so that it does not land
in a fixed phase of the receivers' poll loops (a closed loop would otherwise always wait a full
shm poll period). Every process runs with ``--threads`` torch threads (default 1). Medians over
``--repeats`` versions per size; the JSON in ``benchmarks/results/`` has config, machine, commit,
date and every sample.

    .venv/bin/python -m benchmarks.weight_sync [--max-gb 2] [--repeats 3] [--backends zmq,shm] [--receivers 1,2]
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

from benchmarks._report import machine
from asyncrl.weights import WeightBroadcaster, setup_weight_broadcaster, setup_weight_receiver

GB = 1e9
RESULTS_DIR = Path(__file__).resolve().parent / "results"
SIZES_GB = (0.064, 0.256, 1.0, 2.0)
LLAMA_1B = dict(hidden=2048, intermediate=8192, heads=32, kv_heads=8, head_dim=64, layers=16, vocab=128256)
TINY = dict(hidden=64, intermediate=128, heads=2, kv_heads=1, head_dim=32, layers=2, vocab=128)
LORA_RANK = 16
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_CONFIG = {"r": LORA_RANK, "lora_alpha": 2 * LORA_RANK, "target_modules": list(LINEARS)}
REPORT_TIMEOUT_S = 600.0


# -- payload -------------------------------------------------------------------------------------
def model_shapes(c: dict[str, int], *, bias: bool = False, lm_head: bool = False) -> list[tuple[str, list[int]]]:
    """(name, shape) of a Llama/Qwen2-style state dict in model order, layers before the embedding."""
    h, i, q, kv = c["hidden"], c["intermediate"], c["heads"] * c["head_dim"], c["kv_heads"] * c["head_dim"]
    out = []
    for n in range(c["layers"]):
        p = f"model.layers.{n}"
        for proj, shape in (("q_proj", [q, h]), ("k_proj", [kv, h]), ("v_proj", [kv, h]), ("o_proj", [h, q])):
            out.append((f"{p}.self_attn.{proj}.weight", shape))
            if bias and proj != "o_proj":
                out.append((f"{p}.self_attn.{proj}.bias", shape[:1]))
        for proj, shape in (("gate_proj", [i, h]), ("up_proj", [i, h]), ("down_proj", [h, i])):
            out.append((f"{p}.mlp.{proj}.weight", shape))
        out += [(f"{p}.input_layernorm.weight", [h]), (f"{p}.post_attention_layernorm.weight", [h])]
    out += [("model.norm.weight", [h]), ("model.embed_tokens.weight", [c["vocab"], h])]
    if lm_head:
        out.append(("lm_head.weight", [c["vocab"], h]))
    return out


def nbytes_of(shape: list[int], dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


def make_sizes(max_gb: float) -> list[dict[str, Any]]:
    """The size ladder: tiny, then prefixes of the 1B shapes; each with its tensor names and bytes."""
    tiny = model_shapes(TINY, bias=True, lm_head=True)
    sizes = [{"name": "tiny", "dtype": "float32", "shapes": tiny,
              "bytes": sum(nbytes_of(s, torch.float32) for _, s in tiny)}]
    full = model_shapes(LLAMA_1B)
    for target in [g for g in SIZES_GB if g <= max_gb + 1e-9]:
        prefix, total = [], 0
        for name, shape in full:
            b = nbytes_of(shape, torch.bfloat16)
            if total + b > target * GB:
                break
            prefix.append((name, shape))
            total += b
        sizes.append({"name": f"{total / GB:.3g}GB", "dtype": "bfloat16", "shapes": prefix, "bytes": total})
    return sizes


def make_tensors(shapes: list[tuple[str, list[int]]], dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g, dtype=torch.float32).to(dtype) for name, shape in shapes}


def lora_adapters(shapes: list[tuple[str, list[int]]], seed: int) -> dict[str, torch.Tensor]:
    """peft-named rank-16 adapters (bf16) for every linear projection among ``shapes``."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in shapes:
        module = name.removesuffix(".weight")
        if module.rsplit(".", 1)[-1] in LINEARS:
            out_f, in_f = shape
            prefix = f"base_model.model.{module}"
            out[f"{prefix}.lora_A.weight"] = torch.randn(LORA_RANK, in_f, generator=g).to(torch.bfloat16)
            out[f"{prefix}.lora_B.weight"] = torch.randn(out_f, LORA_RANK, generator=g).to(torch.bfloat16)
    return out


# -- baselines -----------------------------------------------------------------------------------
def memcpy_seconds(tensors: dict[str, torch.Tensor], repeats: int) -> dict[str, list[float]]:
    total = sum(t.nbytes for t in tensors.values())
    dst = torch.zeros(total, dtype=torch.uint8)  # touched: the warm path measures copying only
    warm, fresh = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        offset = 0
        for t in tensors.values():
            dst[offset : offset + t.nbytes].view(t.dtype).view(t.shape).copy_(t)
            offset += t.nbytes
        warm.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        clones = [t.clone() for t in tensors.values()]
        fresh.append(time.perf_counter() - t0)
        del clones
    return {"memcpy": warm, "memcpy_fresh": fresh}


# -- receiver processes --------------------------------------------------------------------------
def receiver_main(backend: str, address: str, receiver_id: str, threads: int, conn: Any) -> None:
    """A worker's side: stage each new version, drop it, commit, report ``staged_at``."""
    torch.set_num_threads(threads)
    r = setup_weight_receiver(backend, address, receiver_id=receiver_id)
    r.start()
    conn.send({"event": "ready"})
    last = 0
    while not conn.poll():
        update = r.wait(last + 1, 0.2)
        if update is None:
            continue
        report = {"event": "staged", "version": update.version, "bytes": update.nbytes, **update.metadata}
        last = update.version
        del update  # free our copy before the next version arrives (the engine would own it)
        r.commit(last)
        conn.send(report)
    stats = r.stats()
    r.close()
    conn.send({"event": "stopped", "failures": stats["failures"], "recent_failures": stats["recent_failures"],
               "peak_rss_gb": peak_rss_gb()})


def peak_rss_gb() -> float | None:
    """This process's peak resident memory (VmHWM; ru_maxrss would include the parent's from before exec)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / GB
    except OSError:
        pass
    return None


class Receivers:
    """N receiver processes of one backend, each reporting over a pipe."""

    def __init__(self, backend: str, address: str, n: int, threads: int):
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for i in range(n):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=receiver_main, args=(backend, address, f"r{i}", threads, child), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        for c in self.conns:
            assert self.recv(c)["event"] == "ready"

    def recv(self, conn: Any) -> dict[str, Any]:
        if not conn.poll(REPORT_TIMEOUT_S):
            raise TimeoutError(f"no report from a receiver within {REPORT_TIMEOUT_S} s")
        return conn.recv()

    def staged(self, version: int) -> list[dict[str, Any]]:
        """Blocks until every receiver staged ``version``; returns their reports."""
        out = []
        for c in self.conns:
            while (report := self.recv(c))["version"] < version:
                pass  # an older version staged before this one was published
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


def run_backend(backend: str, n: int, sizes: list[dict[str, Any]], payloads: dict[str, dict[str, torch.Tensor]],
                args: argparse.Namespace) -> dict[str, Any]:
    b: WeightBroadcaster = setup_weight_broadcaster(backend, keep_versions=1)
    receivers = Receivers(backend, b.address, n, args.threads)
    version, results = 0, {}
    try:
        for size in sizes + [{"name": "lora"}]:
            tensors = payloads[size["name"]]
            samples = []
            for _ in range(args.repeats):
                version += 1
                kw = {"mode": "lora", "lora_config": LORA_CONFIG} if size["name"] == "lora" else {}
                time.sleep(random.uniform(0, 0.025))  # decorrelate from the receivers' poll phase (shm: 20 ms)
                t0 = time.monotonic()
                stats = b.publish(tensors, version, **kw)
                reports = receivers.staged(version)
                latency = max(r["staged_at"] for r in reports) - t0
                samples.append({"latency_s": latency, "publish_s": stats["publish_s"], "bytes": stats["bytes"],
                                "transfer_s": [r["transfer_s"] for r in reports]})
            results[size["name"]] = summarize(samples)
            results[size["name"]]["loadavg_1m"] = os.getloadavg()[0]  # other load on the machine shows up here
            print(f"  {backend} x{n} {size['name']:>8}: {results[size['name']]['gb_per_s']['median']:.3f} GB/s, "
                  f"latency {results[size['name']]['latency_s']['median'] * 1e3:.1f} ms", flush=True)
    finally:
        stopped = receivers.stop()
        b.close()
    return {"sizes": results, "receivers": stopped}


# -- report --------------------------------------------------------------------------------------
def stats_of(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(samples: list[dict[str, Any]]) -> dict[str, Any]:
    nbytes = samples[0]["bytes"]
    return {"bytes": nbytes, "latency_s": stats_of([s["latency_s"] for s in samples]),
            "publish_s": stats_of([s["publish_s"] for s in samples]),
            "gb_per_s": stats_of([nbytes / s["latency_s"] / GB for s in samples]),
            "transfer_gb_per_s": stats_of([nbytes / max(s["transfer_s"]) / GB for s in samples]), "samples": samples}


def print_table(report: dict[str, Any]) -> None:
    paths = list(report["metrics"])
    print("\nend to end, publish -> all staged: GB/s median | latency ms median")
    print(f"{'size':<9}{'bytes':>14}" + "".join(f"{p:>18}" for p in paths))
    for size in report["sizes"]:
        row = f"{size:<9}{report['bytes'][size]:>14,}"
        for p in paths:
            m = report["metrics"][p].get(size)
            if m is None:
                row += f"{'-':>18}"
            else:
                row += f"{m['gb_per_s']['median']:>8.3f} {m['latency_s']['median'] * 1e3:>9.1f}"
        print(row)
    backends = [p for p in paths if not p.startswith("memcpy")]
    print("\nsplit: publish() s median | receiver transfer GB/s median (manifest -> staged, slowest receiver)")
    print(f"{'size':<9}" + "".join(f"{p:>18}" for p in backends))
    for size in report["sizes"]:
        row = f"{size:<9}"
        for p in backends:
            m = report["metrics"][p][size]
            row += f"{m['publish_s']['median']:>8.3f} {m['transfer_gb_per_s']['median']:>9.3f}"
        print(row)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-gb", type=float, default=2.0, help="largest version, GB (1e9 B)")
    p.add_argument("--repeats", type=int, default=3, help="versions published per size")
    p.add_argument("--backends", default="zmq,shm", help="comma-separated subset of zmq,shm")
    p.add_argument("--receivers", default="1,2", help="comma-separated receiver process counts")
    p.add_argument("--threads", type=int, default=1, help="torch threads in every process")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON path (default benchmarks/results/weight_sync-DATE.json)")
    args = p.parse_args(argv)
    args.backends = [s for s in args.backends.split(",") if s]
    args.receivers = [int(s) for s in args.receivers.split(",") if s]
    if set(args.backends) - {"zmq", "shm"} or not args.receivers or min(args.receivers) < 1:
        p.error(f"--backends must be a subset of zmq,shm and --receivers positive ints, "
                f"got {args.backends} {args.receivers}")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    date = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    sizes = make_sizes(args.max_gb)
    largest = sizes[-1]
    full = make_tensors(largest["shapes"], torch.bfloat16, seed=0) if largest["name"] != "tiny" else {}
    payloads = {"tiny": make_tensors(sizes[0]["shapes"], torch.float32, seed=1)}
    for size in sizes[1:]:
        payloads[size["name"]] = {name: full[name] for name, _ in size["shapes"]}  # prefixes share memory
    payloads["lora"] = lora_adapters(largest["shapes"], seed=2)
    metrics: dict[str, dict[str, Any]] = {"memcpy": {}, "memcpy_fresh": {}}
    for name, tensors in payloads.items():
        for path, seconds in memcpy_seconds(tensors, args.repeats).items():
            nbytes = sum(t.nbytes for t in tensors.values())
            metrics[path][name] = {"bytes": nbytes, "latency_s": stats_of(seconds),
                                   "gb_per_s": stats_of([nbytes / s / GB for s in seconds])}
    receivers_info = {}
    for backend in args.backends:
        for n in args.receivers:
            out = run_backend(backend, n, sizes, payloads, args)
            metrics[f"{backend} x{n}"] = out["sizes"]
            receivers_info[f"{backend} x{n}"] = out["receivers"]
    nbytes = {name: sum(t.nbytes for t in tensors.values()) for name, tensors in payloads.items()}
    config = {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "gb": GB,
              "lora_rank": LORA_RANK, "llama_1b": LLAMA_1B, "tiny": TINY,
              "sizes": {s["name"]: {"tensors": len(s["shapes"]), "dtype": s["dtype"]} for s in sizes},
              "lora_of": largest["name"]}
    report = {"benchmark": "weight_sync", "date": date, "config": config, "machine": machine(),
              "sizes": list(payloads), "bytes": nbytes, "metrics": metrics, "receivers": receivers_info,
              "lora_vs_full_bytes": nbytes["lora"] / nbytes[largest["name"]],
              "broadcaster_peak_rss_gb": peak_rss_gb()}
    path = args.out or RESULTS_DIR / f"weight_sync-{date[:10]}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, path)
    print_table(report)
    print(f"\nLoRA rank {LORA_RANK} adapters of {largest['name']}: {nbytes['lora']:,} B = "
          f"{report['lora_vs_full_bytes']:.2%} of the full {nbytes[largest['name']]:,} B")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

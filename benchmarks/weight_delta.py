"""Delta updates (``weights.delta: true``): bytes and time of one update after one optimizer step, against a
full update, on a synthetic Qwen2-0.5B-shaped bf16 model.

The model: Qwen2-0.5B's state dict shapes (hidden 896, intermediate 4864, 14/2 heads, 24 layers, vocab 151936,
q/k/v biases, tied embedding; ~494M parameters, ~0.99 GB in bf16), weights ~N(0, 0.02), norms 1. One real
``torch.optim.AdamW`` step (lr ``--lr``, default 1e-6, torch's other defaults) with N(0, 1) gradients, taken
tensor by tensor (AdamW is elementwise, so this is the same step with one tensor's optimizer state alive at a
time). ``--master fp32`` keeps fp32 master weights and publishes their bf16 cast, as mixed precision does.
Sections, all in one run:

  step      what the step changed: elements with another bf16 bit pattern, per tensor kind.
  codec     :class:`asyncrl.weights.delta.DeltaCodec` on each bucket (``--bucket-mb``): encoded bytes against
            the bucket's, encode and decode seconds (decode includes the result's checksum).
  zmq       end to end over loopback tcp: ``ZmqWeightBroadcaster`` in this process, one
            ``ZmqWeightReceiver`` process that commits what it stages; versions alternate between the two
            weight sets, so each delta update is against the previous version. Latency: ``publish()`` starts
            -> the receiver staged the version (every bucket rebuilt and checksum-verified);
            ``CLOCK_MONOTONIC`` is shared by the processes. Bytes: the broadcaster's ``bytes_served`` for the
            version. CPU: seconds of both processes per update (``process_time``: every thread, the kernel's
            socket copies included), a figure that other jobs on a shared machine disturb far less than the
            latency. Full (``delta=False``) and delta in the same run, ``--repeats`` updates each after the
            first update (one-time costs: buffers allocated, the delta kernels' first call), which is kept
            apart (``first_update``); ``--delta-threads 1,2`` adds a delta section per encoder-thread count.
  recipe    ``--recipe-steps N``: the tiny recipe (``recipes/configs/tiny_cpu.yaml``, fp32, lr 5e-4) under
            torchrun over zmq for N steps, with and without deltas: bytes per update from its metrics.
  lora      ``--lora R``: rank-R adapters (PEFT's names and init: A ~ N(0, 0.02), B = 0) on every q/k/v/o and
            MLP projection of the same model, fp32 (PEFT's dtype) and bf16: the codec section on the last of
            ``--lora-steps`` AdamW steps (lr ``--lora-lr``; the first steps warm the optimizer and move B off
            zero), i.e. what a ``lora``-mode update with ``weights.delta`` sends.
  densities the crossover behind ``delta.XOR_DENSITY``: sparse and xor sizes of random low-bit changes to
            uint16/uint32 words at densities 1e-4..0.9 (``--densities``).

    .venv/bin/python -m benchmarks.weight_delta [--params 0.5e9] [--repeats 3] [--master bf16|fp32] [--densities]
        [--recipe-steps 30] [--delta-threads 1,2] [--lora 16]

Numbers on a shared 2-core machine are noisy; the JSON in ``benchmarks/results/`` has config, machine,
commit, date and every sample.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asyncrl.weights import plan_buckets, setup_weight_broadcaster, setup_weight_receiver
from asyncrl.weights.base import bucket_checksum
from asyncrl.weights.delta import DeltaCodec, delta_word
from benchmarks._report import machine

RESULTS_DIR = Path(__file__).resolve().parent / "results"
QWEN2_05B = {"hidden": 896, "intermediate": 4864, "heads": 14, "kv_heads": 2, "head_dim": 64, "layers": 24, "vocab": 151936}
REPORT_TIMEOUT_S = 600.0


# -- the model and its step ------------------------------------------------------------------------
def model_shapes(c: dict[str, int]) -> list[tuple[str, list[int]]]:
    """(name, shape) of a Qwen2-style state dict (q/k/v biases, tied embedding), layers first."""
    h, i, q, kv = c["hidden"], c["intermediate"], c["heads"] * c["head_dim"], c["kv_heads"] * c["head_dim"]
    out = []
    for n in range(c["layers"]):
        p = f"model.layers.{n}"
        for proj, shape in (("q_proj", [q, h]), ("k_proj", [kv, h]), ("v_proj", [kv, h]), ("o_proj", [h, q])):
            out.append((f"{p}.self_attn.{proj}.weight", shape))
            if proj != "o_proj":
                out.append((f"{p}.self_attn.{proj}.bias", shape[:1]))
        for proj, shape in (("gate_proj", [i, h]), ("up_proj", [i, h]), ("down_proj", [h, i])):
            out.append((f"{p}.mlp.{proj}.weight", shape))
        out += [(f"{p}.input_layernorm.weight", [h]), (f"{p}.post_attention_layernorm.weight", [h])]
    return [*out, ("model.norm.weight", [h]), ("model.embed_tokens.weight", [c["vocab"], h])]


def shapes(params: float) -> list[tuple[str, list[int]]]:
    """Qwen2-0.5B's shapes, with fewer layers and a smaller vocabulary for ``params`` below ~0.5e9."""
    c = dict(QWEN2_05B)
    full = sum(math.prod(s) for _, s in model_shapes(c))
    if params < full:
        scale = params / full
        c["layers"] = max(1, round(c["layers"] * scale))
        c["vocab"] = max(1024, round(c["vocab"] * scale))
    return model_shapes(c)


def stepped_model(params: float, lr: float, master: str, seed: int = 0) -> tuple[dict, dict, dict[str, Any]]:
    """(weights before, weights after one AdamW step, what changed), both bf16."""
    g = torch.Generator().manual_seed(seed)
    before, after, changed = {}, {}, {"elements": 0, "changed": 0, "by_kind": {}}
    for name, shape in shapes(params):
        norm = name.endswith("norm.weight")
        w = torch.ones(shape) if norm else torch.randn(shape, generator=g) * 0.02
        p = torch.nn.Parameter(w if master == "fp32" else w.to(torch.bfloat16))
        before[name] = p.detach().to(torch.bfloat16, copy=True)
        p.grad = torch.randn(shape, generator=g).to(p.dtype)
        torch.optim.AdamW([p], lr=lr).step()
        after[name] = p.detach().to(torch.bfloat16, copy=True)
        n = int((before[name].view(torch.int16) != after[name].view(torch.int16)).sum())
        kind = name.rsplit(".", 2)[-2]
        k = changed["by_kind"].setdefault(kind, {"elements": 0, "changed": 0})
        for d in (changed, k):
            d["elements"] += after[name].numel()
            d["changed"] += n
        del p
    for d in (changed, *changed["by_kind"].values()):
        d["fraction"] = d["changed"] / max(d["elements"], 1)
    return before, after, changed


def _bucket_bytes(bucket, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    buf = torch.zeros(bucket.nbytes, dtype=torch.uint8)
    for s in bucket.slots:
        buf[s.offset : s.offset + s.nbytes].view(tensors[s.name].dtype).view(s.shape).copy_(tensors[s.name])
    return buf


def codec_section(before: dict, after: dict, bucket_bytes: int) -> dict[str, Any]:
    """Every bucket encoded against its base and decoded again (one bucket's buffers alive at a time)."""
    codec = DeltaCodec()
    full = wire = 0
    enc_s = dec_s = 0.0
    encodings: dict[str, int] = {}
    for bucket in plan_buckets(after, bucket_bytes):
        new, base = _bucket_bytes(bucket, after).numpy(), _bucket_bytes(bucket, before).numpy()
        checksum = bucket_checksum(memoryview(new))
        codec.encode(new, base, word=delta_word(bucket), base_version=0, base_incarnation="", checksum=checksum)
        t = time.perf_counter()  # timed the second time: scratch buffers warm, as in a run's later versions
        delta = codec.encode(new, base, word=delta_word(bucket), base_version=0, base_incarnation="",
                             checksum=checksum)
        enc_s += time.perf_counter() - t
        full += bucket.nbytes
        if delta is None:
            wire += bucket.nbytes
            encodings["full"] = encodings.get("full", 0) + 1
            continue
        wire += delta.wire_nbytes
        encodings[delta.encoding] = encodings.get(delta.encoding, 0) + 1
        out = np.zeros_like(new)  # touched: a receiver decodes into its reused receive buffers
        t = time.perf_counter()
        codec.decode(delta, base, base_version=0, base_incarnation="", out=out)
        dec_s += time.perf_counter() - t
        assert np.array_equal(out, new)
    return {"full_bytes": full, "delta_bytes": wire, "ratio": full / max(wire, 1), "encode_s": enc_s,
            "decode_s": dec_s, "encode_gb_per_s": full / enc_s / 1e9, "decode_gb_per_s": full / max(dec_s, 1e-9) / 1e9,
            "buckets": encodings}


def lora_section(rank: int, lr: float, steps: int, dtype: torch.dtype, seed: int = 0) -> dict[str, Any]:
    """Rank-``rank`` adapters in ``dtype`` before and after the last of ``steps`` AdamW steps: the codec section."""
    g = torch.Generator().manual_seed(seed)
    params = {}
    for name, shape in shapes(0.5e9):
        if len(shape) != 2 or "proj" not in name:
            continue
        stem = name.removesuffix(".weight")
        params[f"base_model.model.{stem}.lora_A.weight"] = torch.randn(rank, shape[1], generator=g) * 0.02
        params[f"base_model.model.{stem}.lora_B.weight"] = torch.zeros(shape[0], rank)
    ps = {k: torch.nn.Parameter(v.to(dtype)) for k, v in params.items()}
    opt = torch.optim.AdamW(ps.values(), lr=lr)
    before: dict[str, torch.Tensor] = {}
    for _ in range(steps):
        for p in ps.values():
            p.grad = torch.randn(p.shape, generator=g).to(dtype)
        before = {k: p.detach().clone() for k, p in ps.items()}
        opt.step()
    after = {k: p.detach().clone() for k, p in ps.items()}
    changed = sum(int((before[k] != after[k]).sum()) for k in after) / sum(t.numel() for t in after.values())
    return {"dtype": str(dtype), "rank": rank, "lr": lr, "steps": steps, "changed_fraction": changed,
            **codec_section(before, after, 64 << 20)}


# -- end to end over zmq ---------------------------------------------------------------------------
def _receiver(address: str, delta: bool, versions: int, out: mp.Queue) -> None:
    torch.set_num_threads(1)
    r = setup_weight_receiver("zmq", address, receiver_id=f"bench-{int(delta)}", delta=delta)
    r.start()
    try:
        for v in range(1, versions + 1):
            update = r.wait(v, timeout=REPORT_TIMEOUT_S)
            if update is None:
                out.put(("error", f"version {v} not staged within {REPORT_TIMEOUT_S} s: {r.stats()}"))
                return
            out.put(("staged", update.version, update.metadata["staged_at"], time.process_time()))
            r.commit(update.version)
            del update
        out.put(("stats", r.stats()))
    finally:
        r.close()


def _settled(b, timeout: float = 1.0) -> dict[str, Any]:
    """The broadcaster's stats once ``bytes_served`` stops moving (it counts each bucket just after sending it)."""
    deadline, last = time.monotonic() + timeout, b.stats()
    while time.monotonic() < deadline:
        time.sleep(0.01)
        now = b.stats()
        if now["bytes_served"] == last["bytes_served"]:
            return now
        last = now
    return last


def zmq_section(before: dict, after: dict, *, delta: bool, repeats: int, bucket_bytes: int,
                delta_threads: int = 1) -> dict[str, Any]:
    versions = repeats + 2
    b = setup_weight_broadcaster("zmq", bucket_bytes=bucket_bytes, delta=delta,
                                 **({"delta_threads": delta_threads} if delta else {}))
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(b.address, delta, versions, q), daemon=True)
    proc.start()
    samples = []
    try:
        served, receiver_cpu, encoded, encoded_cpu, first = 0, None, 0.0, 0.0, {}
        for v in range(1, versions + 1):
            tensors = before if v % 2 else after
            load = os.getloadavg()[0]
            cpu0, t0 = time.process_time(), time.monotonic()
            b.publish(tensors, v)
            msg = q.get(timeout=REPORT_TIMEOUT_S)
            if msg[0] != "staged":
                raise RuntimeError(f"receiver: {msg}")
            cpu = time.process_time() - cpu0  # this process until staged (+ the poll below, ~0)
            stats = _settled(b)
            nbytes, served = stats["bytes_served"] - served, stats["bytes_served"]
            # the receiver's CPU since it staged the previous version: this transfer, its commit and idle ticks
            rcpu, receiver_cpu = (None if receiver_cpu is None else msg[3] - receiver_cpu), msg[3]
            # version 1 is every receiver's first copy (full either way), version 2 the first update (one-time costs:
            # buffers allocated, the delta kernels' first call); they are kept apart
            if v == 2:
                first = {"latency_s": msg[2] - t0, "broadcaster_cpu_s": cpu, "receiver_cpu_s": rcpu}
            if v > 2:
                samples.append({"version": v, "latency_s": msg[2] - t0, "bytes": nbytes, "loadavg_1m": load,
                                "broadcaster_cpu_s": cpu, "receiver_cpu_s": rcpu,
                                "encode_s": stats.get("delta_encode_s", 0.0) - encoded,
                                "encode_cpu_s": stats.get("delta_encode_cpu_s", 0.0) - encoded_cpu})
            encoded, encoded_cpu = stats.get("delta_encode_s", 0.0), stats.get("delta_encode_cpu_s", 0.0)
        _, rstats = q.get(timeout=REPORT_TIMEOUT_S)
        proc.join(timeout=30)
    finally:
        if proc.is_alive():
            proc.kill()
        b.close()
    keep = ("bytes_served", "delta_bytes", "full_bytes", "buckets_delta", "buckets_full", "delta_encode_s",
            "delta_encode_cpu_s", "delta_encode_errors", "deltas_encoded",
            "deltas_not_smaller", "deltas_base_not_held")
    return {"delta": delta, "first_update": first, "samples": samples,
            "latency_s": statistics.median(s["latency_s"] for s in samples),
            "cpu_s": statistics.median(s["broadcaster_cpu_s"] + s["receiver_cpu_s"] for s in samples),
            "bytes": statistics.median(s["bytes"] for s in samples),
            "broadcaster": {k: v for k, v in stats.items() if k in keep},
            "receiver": {k: v for k, v in rstats.items() if "delta" in k or "bytes" in k or k == "failures"}}


# -- crossover ------------------------------------------------------------------------------------
def densities_section(n: int = 4_000_000) -> list[dict[str, Any]]:
    """Sizes of both encodings, each measured on its own (encode() keeps only the smaller)."""
    import zstandard

    from asyncrl.weights.delta import _changed, _shuffle

    rng = np.random.default_rng(0)
    z, rows = zstandard.ZstdCompressor(level=1), []
    for dtype, lowbits in ((np.uint16, 3), (np.uint32, 12)):
        for density in (1e-4, 1e-3, 1e-2, 0.05, 0.1, 0.25, 0.5, 0.9):
            x = (rng.integers(1, 1 << lowbits, n).astype(dtype) * (rng.random(n) < density)).astype(dtype)
            t = time.perf_counter()
            positions, values = _changed(x.view(np.uint8), np.zeros(x.nbytes, dtype=np.uint8), x.itemsize)
            gaps = np.diff(positions.astype(np.uint32), prepend=np.uint32(0))
            sparse = len(z.compress(_shuffle(gaps))) + len(z.compress(_shuffle(values)))
            t_sparse = time.perf_counter() - t
            t = time.perf_counter()
            xor = len(z.compress(x.view(np.uint8)))
            t_xor = time.perf_counter() - t
            rows.append({"word": x.itemsize, "density": density, "full": x.nbytes, "sparse": sparse, "xor": xor,
                         "sparse_s": t_sparse, "xor_s": t_xor})
    return rows


# -- the tiny recipe ----------------------------------------------------------------------------------
def recipe_section(steps: int) -> dict[str, Any]:
    """``recipes/configs/tiny_cpu.yaml`` under torchrun (2 ranks, one HF worker each) over zmq, with and without
    deltas; bytes per update from the broadcaster's counters in the last metrics record (the tiny model's
    weights fit one bucket, so buckets served = updates served)."""
    import subprocess
    import sys
    import tempfile

    root = Path(__file__).resolve().parent.parent
    torchrun = Path(sys.executable).with_name("torchrun")
    out: dict[str, Any] = {"steps": steps, "config": "recipes/configs/tiny_cpu.yaml"}
    for delta in (False, True):
        with tempfile.TemporaryDirectory(prefix="weight-delta-recipe-") as run_dir:
            argv = [str(torchrun), "--standalone", "--nproc-per-node", "2", "recipes/grpo.py", "--config",
                    "recipes/configs/tiny_cpu.yaml", f"run_dir={run_dir}", "weights.type=zmq",
                    f"weights.delta={str(delta).lower()}", f"train.steps={steps}", "train.sft_steps=5",
                    "checkpoint.every=100000"]
            subprocess.run(argv, cwd=root, check=True, capture_output=True, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                           timeout=1800)
            rows = [json.loads(line) for line in Path(run_dir, "metrics.jsonl").read_text().splitlines()]
        ws = rows[-1]["pipeline"]["weight_sync"]
        served = ws.get("buckets_full", 0) + ws.get("buckets_delta", 0)
        out[f"delta={delta}"] = {
            **ws, "payload_bytes": rows[-1]["weight_bytes"], "updates_served": served,
            "bytes_per_update": ws["bytes_served"] / max(served, 1),
            "bytes_per_delta_update": ws.get("delta_bytes", 0) / max(ws.get("buckets_delta", 0), 1),
            "workers": rows[-1]["pipeline"]["workers"]}
    out["ratio"] = out["delta=False"]["bytes_per_update"] / out["delta=True"]["bytes_per_update"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=float, default=0.5e9)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--master", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--bucket-mb", type=int, default=64)
    p.add_argument("--delta-threads", default="1", help="the broadcaster's delta encoder threads; a list (1,2): "
                                                          "one delta section each, the first is 'delta'")
    p.add_argument("--densities", action="store_true", help="also the sparse/xor crossover")
    p.add_argument("--no-zmq", action="store_true")
    p.add_argument("--recipe-steps", type=int, default=0, help="> 0: also the tiny recipe with and without deltas")
    p.add_argument("--lora", type=int, default=0, help="> 0: also rank-R LoRA adapters' deltas (codec only)")
    p.add_argument("--lora-lr", type=float, default=1e-5)
    p.add_argument("--lora-steps", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    bucket_bytes = args.bucket_mb << 20
    t = time.perf_counter()
    before, after, changed = stepped_model(args.params, args.lr, args.master)
    nbytes = sum(x.nbytes for x in after.values())
    print(f"model: {sum(x.numel() for x in after.values()) / 1e6:.1f}M params, {nbytes / 1e9:.3f} GB bf16, "
          f"{changed['fraction']:.4%} of the elements changed ({time.perf_counter() - t:.1f} s)")
    result: dict[str, Any] = {
        "benchmark": "weight_delta", "date": dt.datetime.now().isoformat(timespec="seconds"), "machine": machine(),
        "config": {**vars(args), "out": None, "bytes": nbytes, "params_built": sum(x.numel() for x in after.values())},
        "step": changed,
    }
    result["codec"] = codec_section(before, after, bucket_bytes)
    c = result["codec"]
    print(f"codec: {c['full_bytes'] / 1e6:.1f} MB -> {c['delta_bytes'] / 1e6:.2f} MB ({c['ratio']:.1f}x), "
          f"encode {c['encode_gb_per_s']:.2f} GB/s, decode {c['decode_gb_per_s']:.2f} GB/s, buckets {c['buckets']}")
    if not args.no_zmq:
        kw = {"repeats": args.repeats, "bucket_bytes": bucket_bytes}
        full = zmq_section(before, after, delta=False, **kw)
        threads = [int(t) for t in str(args.delta_threads).split(",")]
        deltas = {t: zmq_section(before, after, delta=True, delta_threads=t, **kw) for t in threads}
        delta = deltas[threads[0]]
        result["zmq"] = {"full": full, "delta": delta, "bytes_ratio": full["bytes"] / max(delta["bytes"], 1),
                         "speedup": full["latency_s"] / delta["latency_s"], "cpu_ratio": full["cpu_s"] / delta["cpu_s"],
                         "delta_threads": {t: {"latency_s": d["latency_s"], "cpu_s": d["cpu_s"],
                                               "speedup": full["latency_s"] / d["latency_s"], "section": d}
                                           for t, d in deltas.items() if t != threads[0]}}
        z = result["zmq"]
        loads = [s["loadavg_1m"] for x in (full, *deltas.values()) for s in x["samples"]]
        print(f"zmq tcp: full {full['bytes'] / 1e6:.1f} MB in {full['latency_s']:.3f} s, delta "
              f"{delta['bytes'] / 1e6:.2f} MB in {delta['latency_s']:.3f} s: {z['bytes_ratio']:.1f}x fewer bytes, "
              f"{z['speedup']:.2f}x faster; CPU s per update (both ends) full {full['cpu_s']:.2f}, delta "
              f"{delta['cpu_s']:.2f} ({z['cpu_ratio']:.2f}x less); load average {min(loads):.1f}-{max(loads):.1f}")
        for t, d in z["delta_threads"].items():
            print(f"  delta with {t} encoder threads: {d['latency_s']:.3f} s ({d['speedup']:.2f}x), CPU {d['cpu_s']:.2f} s")
    if args.recipe_steps:
        result["recipe"] = r = recipe_section(args.recipe_steps)
        print(f"tiny recipe: {r['delta=False']['bytes_per_update']:.0f} B per update full, "
              f"{r['delta=True']['bytes_per_update']:.0f} with deltas ({r['ratio']:.2f}x)")
    if args.lora:
        result["lora"] = [lora_section(args.lora, args.lora_lr, args.lora_steps, d)
                          for d in (torch.float32, torch.bfloat16)]
        for r in result["lora"]:
            print(f"lora r={r['rank']} {r['dtype']}: {r['changed_fraction']:.1%} of the elements changed, "
                  f"{r['full_bytes'] / 1e6:.1f} MB -> {r['delta_bytes'] / 1e6:.2f} MB ({r['ratio']:.2f}x), "
                  f"buckets {r['buckets']}")
    if args.densities:
        result["densities"] = densities_section()
        for row in result["densities"]:
            print(row)
    out = args.out or RESULTS_DIR / f"weight_delta-{dt.date.today().isoformat()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""Applying a full update to a vLLM engine: vLLM's native weight-transfer API against the safetensors-bytes RPC.

A Qwen2-shaped model (default: hidden 1024, intermediate 2816, 8 layers, 8/2 heads of 128, vocab 128: 90.6M params,
362 MB in fp32) is published with the shm broadcaster; the worker's receiver stages views into the segment and
``VLLMEngine.apply_weights`` loads them, alternately

  native  ``start_weight_update`` / ``update_weights`` / ``finish_weight_update`` to asyncrl's registered backend,
          which takes the staged views by reference (vLLM's worker in this process);
  rpc     the fallback: the tensors serialized to safetensors bytes, sent through ``collective_rpc`` and loaded by
          ``reload_weights`` (forced here by handing the engine the update without its segment, as if vLLM ran in
          another process and the update came from a zmq receiver).

Both end in the same layerwise reload (on CPU vLLM also re-packs every linear weight for its GEMM kernel, which
both pay). Times are ``apply_weights`` wall clock, medians over ``--repeats`` versions per path after one warm-up,
the paths interleaved in two rounds.

    .venv/bin/python -m benchmarks.vllm_weight_apply [--layers 8] [--hidden 1024] [--repeats 3] [--out x.json]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["main"]


def measure(layers: int, hidden: int, intermediate: int, repeats: int) -> dict[str, Any]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from safetensors.torch import load_file

    import asyncrl.testing.tiny_model as tm
    from asyncrl.config import VllmEngineConfig
    from asyncrl.weights.base import WeightUpdate
    from asyncrl.weights.shm import ShmWeightBroadcaster, ShmWeightReceiver
    from workers.engines import build_engine

    work = Path(tempfile.mkdtemp(prefix="asyncrl-vllm-apply-"))
    shape = {"hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
             "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": hidden // 8, "tie_word_embeddings": False,
             "max_position_embeddings": 256}
    saved, tm.TINY_CONFIG = tm.TINY_CONFIG, shape
    try:
        model_dir = tm.build_tiny_model(work / "model")
    finally:
        tm.TINY_CONFIG = saved
    engine = build_engine(VllmEngineConfig(model=str(model_dir), seed=3, max_model_len=128,
                                       kv_cache_bytes=64 << 20))
    base = load_file(model_dir / "model.safetensors")
    b = ShmWeightBroadcaster(work / "weights")
    r = ShmWeightReceiver(b.address, receiver_id="bench")
    r.start()
    samples: dict[str, list[float]] = {"native": [], "rpc": []}
    version = 0
    try:
        for path in ("native", "rpc") * 2:
            engine._in_process = path == "native"
            for i in range(repeats + 1):
                version += 1
                b.publish({k: t + 1e-3 * version for k, t in base.items()}, version=version)
                update = r.wait(version, 60)
                if path == "rpc":  # without its segment: the fallback path
                    update = WeightUpdate(version=update.version, mode=update.mode, tensors=update.tensors)
                t0 = time.perf_counter()
                engine.apply_weights(update)
                elapsed = time.perf_counter() - t0
                r.commit(version)
                if i:
                    samples[path].append(elapsed)
        stats = dict(engine.weight_transfer_stats)
    finally:
        r.close()
        b.close()
        engine.close()
    nbytes = sum(t.nbytes for t in base.values())
    return {"bytes": nbytes, "params": sum(t.numel() for t in base.values()), "model": shape, "samples_s": samples,
            "median_ms": {k: statistics.median(v) * 1e3 for k, v in samples.items()}, "paths_used": stats}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    from benchmarks._report import machine

    result = {"benchmark": "vllm_weight_apply", "date": dt.datetime.now(dt.timezone.utc).isoformat(),
              "config": vars(args) | {"out": str(args.out)}, "machine": machine()}
    result.update(measure(args.layers, args.hidden, args.intermediate, args.repeats))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("bytes", "median_ms", "paths_used")}))


if __name__ == "__main__":
    main()

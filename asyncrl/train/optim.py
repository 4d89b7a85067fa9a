"""The trainer's optimizer: AdamW, fused where torch has the kernel.

Used by ``recipes/grpo.py`` and meant for a user's own loop (``recipes/drop_in.py``): the update guard
(:mod:`asyncrl.train.guard`) snapshots and restores its state exactly and :mod:`asyncrl.checkpoint.checkpointer` saves
it like any optimizer's. Nothing blocks but the step's kernels.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["adamw"]


def adamw(params: list[torch.Tensor], **kwargs: Any) -> torch.optim.AdamW:
    """The trainer's AdamW, fused (one kernel over every parameter) where torch has the kernel for all of them:
    floating-point parameters on CPU or CUDA. Unfused, torch runs CPU parameters through its per-tensor Python
    loop (``_single_tensor_adamw``), ~6x slower on the tiny model. Same update rule; its state (``step`` a tensor
    on the parameter's device) checkpoints, resumes and is restored by the guard like the unfused one's."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        devices = set(_get_fused_kernels_supported_devices())
    except ImportError:  # a torch without it: the default implementation
        devices = set()
    fused = bool(params) and all(torch.is_floating_point(p) and p.device.type in devices for p in params)
    return torch.optim.AdamW(params, **kwargs, **({"fused": True} if fused else {}))

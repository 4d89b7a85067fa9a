"""Fault for tests/integration/test_check_stages.py, imported by every rank with ``CheckContext.imports``:
FSDP2 places one shard at another rank's offset. After :func:`asyncrl.train.parallel.parallelize`, rank 1's local
shard of ``model.layers.0.self_attn.q_proj.weight`` holds the rows of rank 0's shard (dim-0 offset 0 instead of
its own), as a sharding that computes offsets wrongly would leave it. The ``parallel`` stage must name it."""

from __future__ import annotations

import torch
import torch.distributed as dist

import asyncrl.train.parallel

PARAMETER = "model.layers.0.self_attn.q_proj.weight"
_real = asyncrl.train.parallel.parallelize


def _misplaced(policy, parallel, device):
    model = _real(policy, parallel, device)
    p = dict(model.named_parameters())[PARAMETER]
    full = p.full_tensor()  # a collective: every rank gathers
    if dist.get_rank() == 1:
        local = p.to_local()
        with torch.no_grad():
            local.copy_(full[: local.shape[0]])  # rank 0's rows at rank 1's offset
    return model


asyncrl.train.parallel.parallelize = _misplaced

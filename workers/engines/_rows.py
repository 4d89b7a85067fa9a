"""The rows of one engine call: left-padded prompt ids, and the lengths a request's samples run to with
``engine.ignore_eos`` (shared by the HF engine, its streaming scheduler and the vLLM engine, so every engine draws
the same lengths for the same request).
"""

from __future__ import annotations

import numpy as np
import torch

from asyncrl.config import EngineConfig
from workers.engines.base import GenerationRequest

__all__ = ["left_pad", "length_targets"]


def left_pad(rows: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """1-D token tensors left-padded with ``pad_id`` to the longest: ``(input_ids, attention_mask)``, long tensors
    of shape (rows, width), the mask 1 over each row's tokens (what generate, the lean decode loop and the
    streaming prefill all take)."""
    width = max(r.numel() for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        input_ids[i, width - r.numel():] = r
        attention_mask[i, width - r.numel():] = 1
    return input_ids, attention_mask


def length_targets(config: EngineConfig, request: GenerationRequest, limit: int) -> list[int]:
    """Response lengths of a request's ``n`` samples when ``config.ignore_eos`` is set.

    With ``length_tail > 0``, sample ``s`` draws from a lognormal with median ``length_median`` (None:
    ``2 * min_new_tokens``) and sigma ``length_tail``, seeded by ``(seed, epoch, prompt_index, s)``, so a
    regenerated group has the same lengths; clipped to ``[max(min_new_tokens, 1), limit]``. Otherwise every
    sample runs to ``limit``. A request with its own ``max_new_tokens`` (a chunk of an interruptible
    generation) runs to that limit: the chunks together reach ``max_new_tokens``.

    Args:
        config: the engine config.
        request: the request whose samples need lengths.
        limit: the most new tokens of this call.

    Returns:
        ``request.n`` target lengths in ``[1, limit]``.
    """
    if config.length_tail <= 0 or request.max_new_tokens is not None:
        return [limit] * request.n
    median = config.length_median or max(config.min_new_tokens, 1) * 2
    low = min(max(config.min_new_tokens, 1), limit)
    out = []
    for s in range(request.n):
        rng = np.random.default_rng([config.seed, request.epoch, request.prompt_index, s])
        out.append(int(np.clip(rng.lognormal(np.log(median), config.length_tail), low, limit)))
    return out

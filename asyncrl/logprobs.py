"""Trainer-side token logprobs under the distribution the rollout engines actually sample from.

Every engine reports, per sampled token, its log-probability after temperature, top-k and top-p
(HF ``generate``'s processed scores; vLLM's ``processed_logprobs``). :func:`token_logprobs` is the
teacher-forced counterpart a trainer computes on a collated batch, aligned the same way as
``datapipes.collate``: ``out[b, t]`` is the logprob of ``input_ids[b, t]`` given ``input_ids[b, :t]``.
The engine tests hold every engine to it within 1e-4 (fp32).

The warpers are transformers' own classes, applied in ``generate``'s order (temperature, top-k,
top-p) and skipped when they are no-ops, exactly as ``GenerationMixin._get_logits_processor`` does,
so the two sides cannot drift apart through a re-implementation.
"""

from __future__ import annotations

import torch

__all__ = ["sampling_logprobs", "token_logprobs"]


def _check_sampling(temperature: float, top_k: int, top_p: float) -> None:
    if temperature <= 0:
        raise ValueError(f"{temperature=} must be > 0 (greedy decoding has no sampling distribution)")
    if top_k < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need {top_k=} >= 0 and 0 < {top_p=} <= 1")


def sampling_logprobs(
    logits: torch.Tensor, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    """Log-softmax of the distribution sampled from, over the last dim; filtered-out tokens get ``-inf``.

    Args:
        logits: ``[..., V]`` raw logits; computed in float32 like ``generate`` (which upcasts its scores).
        temperature: > 0; 1 = off.
        top_k: 0 = off.
        top_p: in (0, 1]; 1 = off.

    Returns:
        float32 ``[..., V]`` logprobs.
    """
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    _check_sampling(temperature, top_k, top_p)
    shape = logits.shape
    # TopPLogitsWarper scatters along dim 1, so the warpers see [rows, V].
    scores = logits.reshape(-1, shape[-1]).float()
    if temperature != 1.0:
        scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_k != 0:
        scores = TopKLogitsWarper(top_k=top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p=top_p)(None, scores)
    return torch.log_softmax(scores, dim=-1).reshape(shape)


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    grad: bool = False,
) -> torch.Tensor:
    """Teacher-forced sampling logprob of every token of a right-padded batch.

    Args:
        model: a causal LM returning ``.logits`` ``[B, L, V]`` (HF or peft-wrapped).
        input_ids: ``[B, L]`` ids, prompt + response per row, right-padded.
        attention_mask: ``[B, L]`` 1/True at real tokens.
        temperature, top_k, top_p: the engine's sampling parameters.
        grad: keep the autograd graph (training); False runs under ``torch.no_grad``.

    Returns:
        float32 ``[B, L]`` on the model's device: ``out[b, t]`` = logprob of ``input_ids[b, t]`` given
        the prefix; 0 at ``t = 0`` and at padding. A prompt token outside the top-k/top-p set gets
        ``-inf`` (it could not have been sampled); response tokens an engine sampled never do.
    """
    if input_ids.shape != attention_mask.shape or input_ids.dim() != 2:
        raise ValueError(f"need [B, L] input_ids and attention_mask, got {input_ids.shape=} {attention_mask.shape=}")
    _check_sampling(temperature, top_k, top_p)
    device = next(model.parameters()).device
    input_ids = input_ids.to(device=device, dtype=torch.long)
    mask = attention_mask.to(device=device, dtype=torch.long)
    # Positions count real tokens only, as generate does for its left padding: same RoPE phases.
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.set_grad_enabled(grad):
        logits = model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids).logits
        logp = sampling_logprobs(logits[:, :-1], temperature=temperature, top_k=top_k, top_p=top_p)
        picked = logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
        picked = torch.where(mask[:, 1:].bool(), picked, torch.zeros_like(picked))
        return torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)

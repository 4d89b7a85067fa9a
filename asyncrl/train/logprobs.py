"""Trainer-side token logprobs under the distribution the rollout engines actually sample from.

Every engine reports, per sampled token, its log-probability after temperature, top-k and top-p
(HF ``generate``'s processed scores; vLLM's ``processed_logprobs``). :func:`token_logprobs` is the
teacher-forced counterpart a trainer computes on a collated batch, aligned the same way as
``datapipes.collate``: ``out[b, t]`` is the logprob of ``input_ids[b, t]`` given ``input_ids[b, :t]``.
The engine tests hold every engine to it within 1e-4 (fp32).

The warpers are transformers' own classes, applied in ``generate``'s order (temperature, top-k,
top-p) and skipped when they are no-ops, exactly as ``GenerationMixin._get_logits_processor`` does,
so the two sides cannot drift apart through a re-implementation.

:func:`batch_logprobs` is the call a training loop makes on a ``TrainBatch``: it takes the sampling settings
from the batch (what the workers reported they sampled with), so a loop cannot silently score its rollouts
under another distribution; a batch that mixes settings, or settings that disagree with the ones a caller
expects, is refused with both in the message.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["batch_logprobs", "batch_sampling", "position_ids", "sampling_logprobs", "token_logprobs"]


def _check_sampling(temperature: float, top_k: int, top_p: float) -> None:
    if temperature <= 0:
        raise ValueError(f"{temperature=} must be > 0 (greedy decoding has no sampling distribution)")
    if top_k < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need {top_k=} >= 0 and 0 < {top_p=} <= 1")


def sampling_logprobs(
    logits: torch.Tensor, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
    suppress_token_ids: Sequence[int] = (),
) -> torch.Tensor:
    """Log-softmax of the distribution sampled from, over the last dim; filtered-out tokens get ``-inf``.

    Args:
        logits: ``[..., V]`` raw logits; computed in float32 like ``generate`` (which upcasts its scores).
        temperature: > 0; 1 = off.
        top_k: 0 = off.
        top_p: in (0, 1]; 1 = off.
        suppress_token_ids: ids the engines never sample (``generate(suppress_tokens=...)``: a vision-language
            model's image tokens, :func:`asyncrl.data.images.vision_token_ids`), set to ``-inf`` before the warpers.

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
    if suppress_token_ids:  # SuppressTokensLogitsProcessor: a logits processor, so before every warper
        scores = scores.index_fill(1, torch.tensor(list(suppress_token_ids), device=scores.device), -float("inf"))
    if temperature != 1.0:
        scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_k != 0:
        scores = TopKLogitsWarper(top_k=top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p=top_p)(None, scores)
    return torch.log_softmax(scores, dim=-1).reshape(shape)


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """The position of every token of a left- or right-padded ``[B, L]`` batch: real tokens count ``0, 1, ...``
    from each row's first real token (as ``generate`` does for its left padding: the same RoPE phases on both
    sides), padding gets 0. ``asyncrl check``'s ``loss`` stage holds this to the unpadded row."""
    mask = attention_mask.long()
    return (mask.cumsum(-1) - 1).clamp(min=0)


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    grad: bool = False,
    images: Mapping[str, torch.Tensor] | None = None,
    suppress_token_ids: Sequence[int] = (),
) -> torch.Tensor:
    """Teacher-forced sampling logprob of every token of a right-padded batch.

    Args:
        model: a causal LM returning ``.logits`` ``[B, L, V]`` (HF or peft-wrapped).
        input_ids: ``[B, L]`` ids, prompt + response per row, right-padded.
        attention_mask: ``[B, L]`` 1/True at real tokens.
        temperature, top_k, top_p: the engine's sampling parameters.
        grad: keep the autograd graph (training); False runs under ``torch.no_grad``.
        images: for a vision-language model, the rows' image tensors in row order (``pixel_values``, ...:
            :func:`asyncrl.data.images.processor_inputs` of ``batch["images"]``, the bytes the engines were given);
            the image placeholder tokens are prompt tokens, outside every ``loss_mask``.
        suppress_token_ids: see :func:`sampling_logprobs` (a VLM's image tokens, which its engines never sample).

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
    with torch.set_grad_enabled(grad):
        logits = model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids(mask),
                       **(images or {})).logits
        logp = sampling_logprobs(logits[:, :-1], temperature=temperature, top_k=top_k, top_p=top_p,
                                 suppress_token_ids=suppress_token_ids)
        picked = logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
        picked = torch.where(mask[:, 1:].bool(), picked, torch.zeros_like(picked))
        return torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)


def batch_sampling(batch: Mapping[str, Any], expected: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The sampling settings of a ``TrainBatch`` (``{"temperature", "top_k", "top_p"}``).

    Args:
        batch: a collated batch (``datapipes.collate``).
        expected: the settings the caller configured (e.g. its ``EngineConfig``'s); used for a batch whose
            rollouts did not report theirs, and otherwise must equal the batch's.

    Raises:
        ValueError: the batch mixes settings, disagrees with ``expected``, or has none and ``expected`` is None.
    """
    got = batch.get("sampling")
    want = None if expected is None else {k: expected[k] for k in ("temperature", "top_k", "top_p")}
    if isinstance(got, list):
        raise ValueError(f"this batch mixes sampling settings {got} (its rollouts came from workers configured "
                         "differently); logprobs under one of them would be wrong for the others: give every worker "
                         "the same engine temperature/top_k/top_p")
    if got is None:
        if want is None:
            raise ValueError("this batch does not say what its rollouts were sampled with (rollouts of a sender that "
                             "does not report sampling); pass the engines' settings as expected={'temperature': ..., "
                             "'top_k': ..., 'top_p': ...}")
        return want
    got = {k: got[k] for k in ("temperature", "top_k", "top_p")}
    if want is not None and (float(want["temperature"]), int(want["top_k"]), float(want["top_p"])) != (
            float(got["temperature"]), int(got["top_k"]), float(got["top_p"])):
        raise ValueError(f"the batch's rollouts were sampled with {got}, but the trainer expects {want}: a worker "
                         "runs with other engine settings than the trainer's config")
    return got


def batch_logprobs(model: torch.nn.Module, batch: Mapping[str, Any], *, grad: bool = False,
                   expected: Mapping[str, Any] | None = None, processor: Any = None) -> torch.Tensor:
    """:func:`token_logprobs` of a ``TrainBatch`` under the sampling settings it carries (:func:`batch_sampling`);
    a batch of image prompts needs the model's ``processor``, which re-runs on the rollouts' image bytes.

    Raises:
        ValueError: see :func:`batch_sampling`; a batch with images and no processor.

    Returns:
        float32 ``[B, L]`` aligned to ``batch["input_ids"]``, on the model's device.
    """
    s = batch_sampling(batch, expected)
    images, suppress = None, ()
    if any(batch.get("images") or []):
        if processor is None:
            raise ValueError("this batch has image prompts: pass the model's processor (AutoProcessor of the model "
                             "directory) so their pixel inputs are recomputed")
        from asyncrl.data.images import processor_inputs, vision_token_ids

        p = next(model.parameters())
        images = processor_inputs(processor, batch["images"], device=p.device, dtype=p.dtype)
        suppress = vision_token_ids(processor)
    return token_logprobs(model, batch["input_ids"], batch["attention_mask"], temperature=s["temperature"],
                          top_k=s["top_k"], top_p=s["top_p"], grad=grad, images=images, suppress_token_ids=suppress)

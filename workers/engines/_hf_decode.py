"""The HF engine's static decode loop: the model's forward over its KV cache, without ``generate``'s bookkeeping.

::

    prefill   one forward of the left-padded prompts [N, P] (position ids from the mask, last position's logits only)
    decode    per step: processors(logits) -> scores; log_softmax(scores) -> logp; one uniform per row from the
              generator -> token by inverse CDF (:func:`workers.engines._sampling.sample`, the streaming
              scheduler's sampler too) and its logprob; rows already stopped take the pad token; stop when every
              row has stopped or after max_new_tokens; then one forward of the new tokens [N, 1] over the cache

The forward inputs are those of ``model.generate(do_sample=True)`` (transformers 5.x ``_sample``): ``input_ids``,
``position_ids`` = cumsum of the mask - 1, the 2D mask or none when nothing is padded, a fresh ``DynamicCache``,
``logits_to_keep=1``; the same float32 upcast of the last position's logits, the same warpers in the same order
(:func:`warpers`, which is also what :func:`asyncrl.logprobs.sampling_logprobs` applies on the trainer), the same
pad-after-stop rule. So each token is drawn from exactly ``generate``'s distribution, and its logprob is the one the
trainer's teacher-forced :func:`asyncrl.logprobs.token_logprobs` recomputes (up to float rounding of the batched
forward; ``tests/unit/test_hf_decode.py`` holds it to that). The draw itself differs: ``generate`` calls
``torch.multinomial``, which draws an exponential per vocabulary entry (~195 us a step for 32 rows x 128 tokens on
one CPU thread, ~6% of the tiny model's decode); the inverse CDF draws one uniform per row (~20 us). So the tokens
are not ``generate``'s for the same seed, only from the same distribution. What the loop leaves out of ``generate``
is what costs on a small model: per token, ``generate`` re-derives its inputs (``prepare_inputs_for_generation``:
slicing, clones, kwargs filtering), grows ``input_ids`` and the mask by concatenation, runs its stopping-criteria
list and its output bookkeeping; per call, it validates and copies its generation config. For the tiny model on one
CPU thread that is ~20% of a 32-row x 32-token batch.

It draws from a ``torch.Generator`` the engine seeds (not the process RNG): the same seed replays the same tokens.

Runs on the caller's thread; nothing blocks but the forward passes.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence

import torch

from workers.engines._sampling import sample

__all__ = ["decode", "supports_decode", "warpers"]


def warpers(*, temperature: float, top_k: int, top_p: float, suppress: Sequence[int] = ()) -> list:
    """The logits processors ``generate`` would build for these settings, in its order (suppression, then
    temperature, top-k, top-p; each one only when it changes something, as ``_get_logits_processor`` does)."""
    from transformers.generation.logits_process import (
        SuppressTokensLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    out: list = []
    if suppress:
        out.append(SuppressTokensLogitsProcessor(list(suppress)))
    if temperature != 1.0:
        out.append(TemperatureLogitsWarper(temperature))
    if top_k:
        out.append(TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=1))
    if top_p < 1.0:
        out.append(TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1))
    return out


def supports_decode(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a decoder-only LM whose forward takes a ``DynamicCache``, ``position_ids`` and
    ``logits_to_keep`` (the inputs this loop gives it); otherwise the engine calls ``generate``. A peft wrapper is
    judged by the model it wraps (it passes these through)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return _supports(type(base))


@functools.cache
def _supports(cls: type) -> bool:
    config_class = getattr(cls, "config_class", None)
    supports_cache = getattr(cls, "_supports_default_dynamic_cache", None)
    if supports_cache is None or getattr(config_class, "is_encoder_decoder", False) or not supports_cache():
        return False
    params = inspect.signature(cls.forward).parameters
    return all(name in params for name in ("past_key_values", "position_ids", "logits_to_keep"))


def decode(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    processors: Sequence,
    stop_ids: torch.Tensor | None,
    pad_id: int,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples up to ``max_new_tokens`` tokens after each left-padded row of ``input_ids``.

    Args:
        model: the causal LM (eval mode), on the device of ``input_ids``.
        input_ids: ``[N, P]`` left-padded prompts.
        attention_mask: ``[N, P]``, 1 on real tokens.
        max_new_tokens: >= 1.
        processors: called as ``p(None, scores)`` in order on the float32 ``[N, V]`` logits (:func:`warpers`).
        stop_ids: a row stops after sampling one of these (kept); None: rows run to ``max_new_tokens``.
        pad_id: what a stopped row is fed (and reports) until every row has stopped.
        generator: the random stream of the uniforms (one float64 per row and step), on the model's device.

    Returns:
        ``(sequences [N, P + T], logprobs [N, T])`` with ``T <= max_new_tokens`` the steps run; ``logprobs`` are
        those of each sampled token under the processed distribution (pad positions of stopped rows included, as
        ``generate``'s scores have them). Ordinary tensors (the loop runs under ``torch.inference_mode``, which
        saves per-op autograd bookkeeping; its results are cloned out of it).

    Raises:
        ValueError: ``max_new_tokens < 1`` or ``attention_mask`` not shaped like ``input_ids``.
    """
    if max_new_tokens < 1 or attention_mask.shape != input_ids.shape:
        raise ValueError(f"need {max_new_tokens=} >= 1 and attention_mask of shape {tuple(input_ids.shape)}, "
                         f"got {tuple(attention_mask.shape)}")
    with torch.inference_mode():
        seqs, logprobs = _decode(model, input_ids, attention_mask, max_new_tokens, processors, stop_ids, pad_id,
                                 generator)
    return seqs.clone(), logprobs.clone()


def _decode(model, input_ids, attention_mask, max_new_tokens, processors, stop_ids, pad_id, generator):
    """:func:`decode`'s loop, in inference mode."""
    from transformers import DynamicCache

    rows, width = input_ids.shape
    device = input_ids.device
    padded = not bool((attention_mask == 1).all())
    position_ids = attention_mask.long().cumsum(-1) - 1
    position_ids = position_ids.masked_fill(attention_mask == 0, 0)
    steps_pos = position_ids[:, -1:] + 1 + torch.arange(max_new_tokens, device=device)  # [N, T]
    # The mask as generate grows it, preallocated: step t passes its first width + t + 1 columns.
    mask = torch.ones((rows, width + max_new_tokens), dtype=attention_mask.dtype, device=device)
    mask[:, :width] = attention_mask
    tokens = torch.full((rows, max_new_tokens), pad_id, dtype=input_ids.dtype, device=device)
    logprobs = torch.zeros((rows, max_new_tokens), dtype=torch.float32, device=device)
    unfinished = torch.ones(rows, dtype=torch.long, device=device)
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))

    out = model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask[:, :width] if padded else None,
                past_key_values=cache, use_cache=True, logits_to_keep=1, return_dict=True)
    steps = 0
    for t in range(max_new_tokens):
        scores = out.logits[:, -1].to(copy=True, dtype=torch.float32)
        del out
        for p in processors:
            scores = p(None, scores)
        logp = torch.log_softmax(scores, dim=-1)
        u = torch.rand(rows, generator=generator, dtype=torch.float64, device=generator.device)
        token, chosen = sample(logp, u)
        if stop_ids is not None:  # a stopped row reports the pad's logprob (as generate's scores have it)
            token = token * unfinished + pad_id * (1 - unfinished)
            chosen = logp.gather(-1, token[:, None]).squeeze(1)
        tokens[:, t] = token
        logprobs[:, t] = chosen
        steps = t + 1
        if stop_ids is not None:
            unfinished = unfinished & ~torch.isin(token, stop_ids)
            if not bool(unfinished.any()):
                break
        if steps == max_new_tokens:
            break
        out = model(input_ids=token[:, None], position_ids=steps_pos[:, t : t + 1],
                    attention_mask=mask[:, : width + t + 1] if padded else None, past_key_values=cache,
                    use_cache=True, logits_to_keep=1, return_dict=True)
    return torch.cat([input_ids, tokens[:, :steps]], dim=1), logprobs[:, :steps]

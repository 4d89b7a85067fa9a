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
(:func:`warpers`, which is also what :func:`asyncrl.train.logprobs.sampling_logprobs` applies on the trainer), the same
pad-after-stop rule. So each token is drawn from exactly ``generate``'s distribution, and its logprob is the one the
trainer's teacher-forced :func:`asyncrl.train.logprobs.token_logprobs` recomputes (up to float rounding of the batched
forward; ``tests/unit/workers/engines/test_hf_decode.py`` holds it to that). The draw itself differs: ``generate`` calls
``torch.multinomial``, which draws an exponential per vocabulary entry (~195 us a step for 32 rows x 128 tokens on
one CPU thread, ~6% of the tiny model's decode); the inverse CDF draws one uniform per row (~20 us). So the tokens
are not ``generate``'s for the same seed, only from the same distribution. What the loop leaves out of ``generate``
is what costs on a small model: per token, ``generate`` re-derives its inputs (``prepare_inputs_for_generation``:
slicing, clones, kwargs filtering), grows ``input_ids`` and the mask by concatenation, runs its stopping-criteria
list and its output bookkeeping; per call, it validates and copies its generation config. For the tiny model on one
CPU thread that is ~20% of a 32-row x 32-token batch.

It draws from a ``torch.Generator`` the engine seeds (not the process RNG): the same seed replays the same tokens.

``engine.compile`` (:class:`CompiledStep`): the prefill as above (over a ``StaticCache`` instead), then every step
a forward compiled by ``torch.compile`` (inductor, ``dynamic=False``) over that cache, the batch padded to a bucket
of rows and cache columns. The same uniforms, so the same tokens up to the float rounding of fused kernels. For
the tiny model (a step's 32 rows, <= 32 tokens, one CPU thread) the whole decode took 99 ms against 122 ms eager
(``python benchmarks/trl_peer.py --engine``, quiet; medians of 10 interleaved rounds); compiling a bucket takes ~5 s (~25 s on a
loaded machine). On a GPU, ``CompiledStep(mode="reduce-overhead")`` (CUDA graphs) is the next step: the cache keeps its
addresses and the logits are copied out before the next replay (not tried: no GPU here).

Runs on the caller's thread; nothing blocks but the forward passes.
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
from collections.abc import Sequence

import torch

from workers.engines._sampling import sample

__all__ = ["CompiledStep", "decode", "supports_decode", "warpers"]

logger = logging.getLogger(__name__)

MAX_SHAPES = 8
"""Most (rows, cache length) buckets one :class:`CompiledStep` compiles; a batch outside them decodes eagerly."""
LENGTH_QUANTUM = 32
"""The static cache's length is prompt width + max_new_tokens rounded up to a multiple of this."""


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
    compiled: CompiledStep | None = None,
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
        compiled: decode through its compiled step over a static cache (``engine.compile``; the same uniforms, so
            the same tokens up to float rounding of the fused kernels); None, or one that failed: the eager loop.

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
        seqs = None
        if compiled is not None and (shape := compiled.shape(*input_ids.shape, max_new_tokens)) is not None:
            state = generator.get_state()
            try:
                seqs, logprobs = _decode(model, input_ids, attention_mask, max_new_tokens, processors, stop_ids,
                                         pad_id, generator, compiled=compiled, shape=shape)
            except Exception as e:  # noqa: BLE001 - any failure to compile or run it: the eager loop, from now on
                compiled.fail(e)
                generator.set_state(state)  # the eager loop draws the uniforms the failed call drew
        if seqs is None:
            seqs, logprobs = _decode(model, input_ids, attention_mask, max_new_tokens, processors, stop_ids, pad_id,
                                     generator)
    return seqs.clone(), logprobs.clone()


class CompiledStep:
    """``engine.compile``: the lean loop's one-token decode step compiled by ``torch.compile`` over a ``StaticCache``.

    The prefill stays eager (its width changes with every batch); each step then runs the compiled forward of
    ``[R, 1]`` tokens over a static cache of ``L`` columns. ``R`` is the batch's rows rounded up to a power of two
    (the extra rows are 1-token dummies fed the pad, their samples dropped) and ``L`` the prompt width +
    ``max_new_tokens`` rounded up to :data:`LENGTH_QUANTUM`, so every shape is static (``dynamic=False``) and a run
    compiles a few of them, each once: at most :data:`MAX_SHAPES` (then that batch decodes eagerly, logged once).
    One ``StaticCache`` per shape is kept and reset between calls (its tensors keep their addresses, which is also
    what CUDA graphs, ``mode="reduce-overhead"``, need; a step's logits are copied before the next step runs).

    How transformers 5.x drives a static cache: each layer writes at its own ``cumulative_length`` (a tensor it
    advances by the tokens written, the prefill's ``P`` first), not at a ``cache_position`` the caller passes, and
    the mask it builds spans all ``L`` columns with the query at that offset. So the caller passes a 2D mask of the
    full ``[R, L]``: the prompts' padding 0, every later column 1 (causality hides the columns not yet written), the
    same tensor every step; and position ids as the eager loop computes them (each row's real tokens counted).

    A failure (no compiler, an unsupported model, an error inside the compiled step) is logged once with its reason
    and the caller's batch, and every later one, decodes eagerly (:func:`decode` replays the generator's state).
    """

    def __init__(self, mode: str | None = None):
        self.mode = mode
        """``torch.compile``'s mode: None (inductor's default) or ``reduce-overhead`` (CUDA graphs, on a GPU)."""
        self.failed: str | None = None
        """Why compiling or running the step failed (then every call is eager), else None."""
        self.compiles = 0
        """Shapes compiled (first calls of a (model, rows, length) bucket), each compile_s long."""
        self.compile_s = 0.0
        self._model: torch.nn.Module | None = None
        self._fn = None
        self._shapes: set[tuple[int, int]] = set()
        self._seen: set[tuple[int, int]] = set()
        self._caches: dict[tuple[int, int], object] = {}
        self._refused = False

    def shape(self, rows: int, width: int, max_new_tokens: int) -> tuple[int, int] | None:
        """The ``(R, L)`` bucket of a batch, or None: decode it eagerly (failed, or past :data:`MAX_SHAPES`)."""
        if self.failed is not None:
            return None
        length = -(-(width + max_new_tokens) // LENGTH_QUANTUM) * LENGTH_QUANTUM
        key = (1 << (rows - 1).bit_length(), length)
        if key not in self._shapes and len(self._shapes) >= MAX_SHAPES:
            if not self._refused:
                logger.warning("engine.compile: %d shapes compiled already; batches of other (rows, cache length) "
                               "buckets, like %s, decode eagerly", MAX_SHAPES, key)
                self._refused = True
            return None
        self._shapes.add(key)
        return key

    def fail(self, error: BaseException) -> None:
        self.failed = f"{type(error).__name__}: {error}"
        logger.warning("engine.compile: the compiled decode step failed (%s); decoding eagerly from now on",
                       self.failed, exc_info=error)
        self._fn = self._model = None
        self._caches.clear()

    def cache(self, model: torch.nn.Module, key: tuple[int, int]):
        """The shape's ``StaticCache``, reset."""
        from transformers import StaticCache

        cache = self._caches.get(key)
        if cache is None:
            cache = self._caches[key] = StaticCache(config=model.config.get_text_config(decoder=True),
                                                    max_cache_len=key[1])
        else:
            cache.reset()
        return cache

    def step(self, model: torch.nn.Module, key: tuple[int, int], **inputs):
        """The compiled forward of one step (compiled for this model on first use; a new model, e.g. wrapped by
        peft, compiles again)."""
        if model is not self._model:
            self._fn = torch.compile(model, dynamic=False, mode=self.mode)
            self._model = model
            self._seen.clear()
        if key in self._seen:
            return self._fn(**inputs)
        t0 = time.perf_counter()
        out = self._fn(**inputs)
        self._seen.add(key)
        self.compiles += 1
        self.compile_s += time.perf_counter() - t0
        logger.info("engine.compile: compiled the decode step for %d rows x %d cache columns in %.1f s", *key,
                    time.perf_counter() - t0)
        return out


def _decode(model, input_ids, attention_mask, max_new_tokens, processors, stop_ids, pad_id, generator, *,
            compiled: CompiledStep | None = None, shape: tuple[int, int] | None = None):
    """:func:`decode`'s loop, in inference mode: over a ``DynamicCache``, or ``compiled``'s step over a static cache
    of ``shape`` (the batch padded to its rows with 1-token dummy rows)."""
    from transformers import DynamicCache

    rows, width = input_ids.shape
    device = input_ids.device
    if compiled is not None:
        extra = shape[0] - rows
        if extra:  # dummy rows: one real (pad) token each, fed the pad, dropped from the results
            input_ids = torch.cat([input_ids, input_ids.new_full((extra, width), pad_id)])
            dummy = attention_mask.new_zeros((extra, width))
            dummy[:, -1] = 1
            attention_mask = torch.cat([attention_mask, dummy])
        padded = True
        cache = compiled.cache(model, shape)
        # The whole cache's mask, the same tensor every step: the prompts' padding 0, the rest 1 (causal hides the
        # columns not yet written).
        mask = torch.ones((shape[0], shape[1]), dtype=attention_mask.dtype, device=device)
    else:
        padded = not bool((attention_mask == 1).all())
        cache = DynamicCache(config=model.config.get_text_config(decoder=True))
        # The mask as generate grows it, preallocated: step t passes its first width + t + 1 columns.
        mask = torch.ones((rows, width + max_new_tokens), dtype=attention_mask.dtype, device=device)
    mask[:, :width] = attention_mask
    position_ids = attention_mask.long().cumsum(-1) - 1
    position_ids = position_ids.masked_fill(attention_mask == 0, 0)
    steps_pos = position_ids[:, -1:] + 1 + torch.arange(max_new_tokens, device=device)  # [R, T]
    tokens = torch.full((rows, max_new_tokens), pad_id, dtype=input_ids.dtype, device=device)
    logprobs = torch.zeros((rows, max_new_tokens), dtype=torch.float32, device=device)
    unfinished = torch.ones(rows, dtype=torch.long, device=device)
    fill = input_ids.new_full((input_ids.shape[0] - rows,), pad_id)  # the dummy rows' tokens

    out = model(input_ids=input_ids, position_ids=position_ids,
                attention_mask=(mask if compiled is not None else mask[:, :width]) if padded else None,
                past_key_values=cache, use_cache=True, logits_to_keep=1, return_dict=True)
    steps = 0
    for t in range(max_new_tokens):
        scores = out.logits[:rows, -1].to(copy=True, dtype=torch.float32)
        out = None  # the step's logits are not kept while the next step runs
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
        if compiled is not None:
            out = compiled.step(model, shape, input_ids=torch.cat([token, fill])[:, None],
                                position_ids=steps_pos[:, t : t + 1].contiguous(), attention_mask=mask,
                                past_key_values=cache, use_cache=True, logits_to_keep=1, return_dict=True)
        else:
            out = model(input_ids=token[:, None], position_ids=steps_pos[:, t : t + 1],
                        attention_mask=mask[:, : width + t + 1] if padded else None, past_key_values=cache,
                        use_cache=True, logits_to_keep=1, return_dict=True)
    return torch.cat([input_ids[:rows], tokens[:, :steps]], dim=1), logprobs[:, :steps]

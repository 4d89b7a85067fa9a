"""The HF transformers engine: ``model.generate`` in the worker process, CPU or CUDA.

All samples of all requests in a call decode together as one left-padded batch. The logprob of
each sampled token is read from ``generate``'s processed scores (after temperature, top-k, top-p),
i.e. the distribution actually sampled from, which is what :func:`asyncrl.train.logprobs.token_logprobs`
computes on the trainer. The model's own ``generation_config`` is replaced by a blank one at load
time so that defaults shipped with a checkpoint (a repetition penalty, a top-k) cannot change the
sampled distribution behind the engine config's back.

Sampling is reproducible: call ``i`` of an engine seeds ``(config.seed, i)`` into the engine's own
``torch.Generator`` (a forked RNG for ``generate``), so the process-wide RNG is left alone. A text-only
decoder-only model decodes with :func:`workers.engines._hf_decode.decode` (the model's forward over its KV cache,
without ``generate``'s per-token bookkeeping, ~20% less time per batch for the tiny model, and an inverse-CDF
draw instead of ``torch.multinomial``: the same distributions and logprobs, other tokens for the same seed; with
``engine.compile`` its decode step is compiled, :class:`~workers.engines._hf_decode.CompiledStep`); a
vision-language model, or one whose forward does not take a ``DynamicCache``, goes through
``generate``. Weights: a ``full`` update loads a state dict (HF names,
strict, dropping any adapter); a ``lora`` update wraps the model with peft on first use and loads the
adapter state dict (the LoRA config is fixed from then on). With shadow weights (``weights.shadow``,
:meth:`HFEngine.shadow_weights`) a ``full`` update the receiver staged over the shadow is applied by swapping the
shadow's storage with the module's (``param.data``, O(1) per tensor, ties kept) instead of copying it. With ``engine.quantization=nf4`` the base is
the trainer's 4-bit QLoRA base (:func:`asyncrl.models.qlora.load_quantized_base`) and only ``lora`` updates apply.

Long-tailed workloads (benchmarks): with ``engine.ignore_eos`` no stop token (EOS or
``stop_token_ids``) ends a response. Each response then has a target length: drawn from the lognormal
of ``engine.length_tail`` (see :func:`workers.engines._rows.length_targets`) or, with ``length_tail = 0``, the token
limit. The batch is generated to its longest target and each row is cut to its own (finish reason
``length``); the sampling distribution, and so the per-token logprobs, are exactly those of a normal
call. ``Completion.text`` is the text up to the first stop token, so rewards still score the answer.

Streaming (``worker.streaming``): :meth:`HFEngine.submit` / :meth:`HFEngine.poll` run the engine-side continuous
batching of :mod:`workers.engines.hf_stream` (up to ``engine.max_num_seqs`` rows decoding at once, a request
returned the moment its ``n`` samples are done, weight updates applied in flight: ``keep`` re-prefills the running
rows under the new weights, ``abort`` returns their requests aborted). ``generate`` stays the static path.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch

from asyncrl.config import HFEngineConfig
from asyncrl.data.images import prompt_images, vision_token_ids
from asyncrl.models.loading import load_causal_lm, load_processor
from workers.engines._hf_decode import CompiledStep, decode, supports_decode, warpers
from workers.engines._multimodal import hf_image_inputs
from workers.engines._rows import left_pad, length_targets
from workers.engines.base import Completion, Engine, Finished, GenerationRequest, prompt_token_ids
from workers.engines.hf_stream import StreamScheduler

__all__ = ["HFEngine"]

logger = logging.getLogger(__name__)

_MAX_LISTED = 8
"""Most key names quoted in an error message."""


def _listed(keys: set[str]) -> str:
    names = sorted(keys)
    more = f" (+{len(names) - _MAX_LISTED} more)" if len(names) > _MAX_LISTED else ""
    return f"{names[:_MAX_LISTED]}{more}"


class HFEngine(Engine):
    streaming = True

    def __init__(self, config: HFEngineConfig):
        from transformers import AutoTokenizer, GenerationConfig

        if config.type != "hf" or not config.model:
            raise ValueError(f"HFEngine needs engine.type='hf' and engine.model, got {config.type=} {config.model=}")
        if config.max_new_tokens < 1:
            raise ValueError(f"engine.{config.max_new_tokens=} must be >= 1 for the hf engine")
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = getattr(torch, config.dtype)
        self.tokenizer = AutoTokenizer.from_pretrained(config.model)
        if config.quantization == "nf4":  # QLoRA: the trainer's 4-bit base, loaded by the same function
            from asyncrl.models.qlora import load_quantized_base

            self.model = load_quantized_base(config.model, dtype=config.dtype, device=self.device).eval()
        else:
            self.model = load_causal_lm(config.model, self.dtype).to(self.device).eval()
        self.processor = load_processor(config.model)
        """The model's ``AutoProcessor`` for a vision-language model (image prompts), else None."""
        self._suppress = vision_token_ids(self.processor)  # a VLM never samples an image slot (asyncrl.data.images)
        eos = self.tokenizer.eos_token_id
        if eos is None and not config.stop_token_ids:
            raise ValueError(f"tokenizer of {config.model!r} has no eos token; set engine.stop_token_ids")
        self.stop_ids = list(dict.fromkeys(([eos] if eos is not None else []) + list(config.stop_token_ids)))
        self._stop_tensor = torch.tensor(self.stop_ids)  # made once: _completion runs per row
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.stop_ids[0]
        # With ignore_eos the blank config has no EOS either: generate fills unset values from it.
        self.model.generation_config = GenerationConfig(
            bos_token_id=self.tokenizer.bos_token_id,
            eos_token_id=None if config.ignore_eos else self.stop_ids,
            pad_token_id=self.pad_id,
        )
        self._base_shapes = {name: tuple(t.shape) for name, t in self.model.state_dict().items()}
        self.policy_version = 0
        self._calls = 0
        self._lora_config: dict[str, Any] | None = None
        """The normalised ``LoraConfig.to_dict()`` the model is wrapped with; None = no adapter."""
        self._shadow = None
        """The :class:`~asyncrl.weights.shadow.ShadowWeights` the receiver fills (``weights.shadow``), made on demand."""
        self._stream = None
        """The streaming scheduler (:mod:`workers.engines.hf_stream`), made by the first ``submit``."""
        self._static_busy_s = 0.0
        self._static_capacity_s = 0.0
        self._compiled = None
        """``engine.compile``: the lean loop's compiled step (:class:`~workers.engines._hf_decode.CompiledStep`)."""
        if config.compile and self.processor is None and supports_decode(self.model):
            self._compiled = CompiledStep()
            if config.max_num_seqs:
                self._warm_up(config.max_num_seqs)
        elif config.compile:
            logger.warning("engine.compile: %s does not decode by the lean loop (a vision-language model, or a forward "
                           "without a DynamicCache): generate runs eagerly", config.model)

    def _warm_up(self, rows: int) -> None:
        """Compiles the decode step for ``rows`` one-token prompts (the cache-length bucket of short prompts) before
        the first call, so that call does not pay for it."""
        t0 = time.perf_counter()
        ids = torch.full((rows, 1), self.pad_id, dtype=torch.long, device=self.device)
        decode(self.model, ids, torch.ones_like(ids), max_new_tokens=self.config.max_new_tokens, processors=[],
               stop_ids=None, pad_id=self.pad_id, generator=torch.Generator(device=self.device).manual_seed(0),
               compiled=self._compiled)
        logger.info("engine.compile: warmed up for %d rows in %.1f s (%s)", rows, time.perf_counter() - t0,
                    self._compiled.failed or "compiled")

    # -- generation ---------------------------------------------------------------------------------

    def _prompt_ids(self, prompt: Any) -> torch.Tensor:
        ids = prompt_token_ids(prompt, self.tokenizer)
        if ids.numel() == 0:
            raise ValueError(f"empty prompt {prompt!r:.200}: generate needs at least one token")
        return ids

    def _seed(self) -> int:
        self._calls += 1
        return int(np.random.SeedSequence([self.config.seed, self._calls]).generate_state(1, dtype=np.uint64)[0] >> 1)

    def generate(self, requests: list[GenerationRequest]) -> list[list[Completion]]:
        if not requests:
            return []
        if self.config.seed_per_prompt and len(requests) > 1:
            return [self._generate([r], seed=self._prompt_seed(r))[0] for r in requests]
        if self.config.seed_per_prompt:
            return self._generate(requests, seed=self._prompt_seed(requests[0]))
        return self._generate(requests, seed=self._seed())

    def _prompt_seed(self, r: GenerationRequest) -> int:
        state = np.random.SeedSequence([self.config.seed, r.epoch, r.prompt_index, self.policy_version])
        return int(state.generate_state(1, dtype=np.uint64)[0] >> 1)

    def _generate(self, requests: list[GenerationRequest], seed: int) -> list[list[Completion]]:
        prompts = [self._prompt_ids(r.prompt) for r in requests]
        rows = [p for p, r in zip(prompts, requests) for _ in range(r.n)]
        if not rows:
            return [[] for _ in requests]
        input_ids, attention_mask = left_pad(rows, self.pad_id)
        width = input_ids.shape[1]
        limits = {r.max_new_tokens or self.config.max_new_tokens for r in requests}
        if len(limits) != 1:
            raise ValueError(f"one generate call needs one max_new_tokens, got {sorted(limits)}")
        limit = limits.pop()
        if self.config.ignore_eos:
            targets = [t for r in requests for t in length_targets(self.config, r, limit)]
            limit = max(targets)
        else:
            targets = [None] * len(rows)
        images = hf_image_inputs(self.processor, [r.prompt for r in requests for _ in range(r.n)],
                                 device=self.device, dtype=self.model.dtype)
        t0 = time.perf_counter()
        seqs, scores = self._sample(input_ids.to(self.device), attention_mask.to(self.device), limit, seed, images)
        call_s = time.perf_counter() - t0
        completions = [self._completion(p, seqs[i, width:], scores[i], targets[i]) for i, p in enumerate(rows)]
        # Occupancy: a row is busy until its own last token, taken as its share of the call's decode steps.
        steps = max(scores.shape[1], 1)
        self._static_busy_s += call_s * sum(c.response_ids.numel() for c in completions) / steps
        self._static_capacity_s += call_s * max(len(rows), self.config.max_num_seqs or 0)
        out, start = [], 0
        for r in requests:
            out.append(completions[start : start + r.n])
            start += r.n
        return out

    def _sample(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int, seed: int,
        images: dict[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sampled sequences ``[N, P + T]`` and the logprob of each sampled token ``[N, T]`` (CPU); ``images``: the
        rows' image tensors (``workers.engines._multimodal.hf_image_inputs``). The lean decode loop where it
        applies (text-only, no processor, a forward that takes a ``DynamicCache``), else ``generate``."""
        if not images and self.processor is None and supports_decode(self.model):
            return self._sample_decode(input_ids, attention_mask, max_new_tokens, seed)
        return self._sample_generate(input_ids, attention_mask, max_new_tokens, seed, images)

    def _sample_decode(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int, seed: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_sample` by :func:`workers.engines._hf_decode.decode`, drawing from a generator seeded ``seed``."""
        c = self.config
        generator = torch.Generator(device=self.device).manual_seed(seed)
        seqs, logprobs = decode(
            self.model, input_ids, attention_mask, max_new_tokens=max_new_tokens,
            processors=warpers(temperature=c.temperature, top_k=c.top_k, top_p=c.top_p, suppress=self._suppress),
            stop_ids=None if c.ignore_eos else self._stop_tensor.to(self.device), pad_id=self.pad_id,
            generator=generator, compiled=self._compiled,
        )
        return seqs.cpu(), logprobs.cpu()

    @torch.no_grad()
    def _sample_generate(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int, seed: int,
        images: dict[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_sample` by ``model.generate``, the process RNG forked and seeded ``seed``."""
        c = self.config
        if self.device.type == "cuda":
            devices = [self.device.index if self.device.index is not None else torch.cuda.current_device()]
        else:
            devices = []
        with torch.random.fork_rng(devices=devices, device_type=self.device.type if devices else "cuda"):
            torch.manual_seed(seed)
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                do_sample=True,
                temperature=c.temperature,
                top_k=c.top_k,
                top_p=c.top_p,
                max_new_tokens=max_new_tokens,
                pad_token_id=self.pad_id,
                return_dict_in_generate=True,
                output_scores=True,
                eos_token_id=None if c.ignore_eos else self.stop_ids,
                **(images or {}),
                **({"suppress_tokens": self._suppress} if self._suppress else {}),
            )
        new = out.sequences[:, input_ids.shape[1] :]
        # One step at a time: a [N, T, V] log-softmax would double the memory generate already holds.
        steps = [torch.log_softmax(s.float(), dim=-1).gather(-1, new[:, t, None]) for t, s in enumerate(out.scores)]
        logprobs = torch.cat(steps, dim=1)
        return out.sequences.cpu(), logprobs.cpu()

    def _completion(
        self, prompt_ids: torch.Tensor, new: torch.Tensor, logprobs: torch.Tensor, target: int | None = None
    ) -> Completion:
        """One row of ``generate``'s output: cut after the first stop token, or at ``target`` (``ignore_eos``)."""
        stops = torch.isin(new, self._stop_tensor.to(new.dtype)).nonzero()
        first_stop = int(stops[0, 0]) if stops.numel() else None
        if target is not None:
            length, finish = target, "length"
            text_end = length if first_stop is None else min(first_stop, length)
        else:
            length = first_stop + 1 if first_stop is not None else new.numel()
            finish = "stop" if first_stop is not None else "length"
            text_end = length
        response = new[:length].to(torch.int32)
        return Completion(
            prompt_ids=prompt_ids,
            response_ids=response,
            logprobs=logprobs[:length].to(torch.float32),
            finish_reason=finish,
            policy_version=self.policy_version,
            text=self.decode(response[:text_end]),
        )

    # -- streaming --------------------------------------------------------------------------------------

    def submit(self, key: int, request: GenerationRequest) -> None:
        """Queues ``request.n`` samples for the running batch (decoded in :meth:`poll`).

        Raises:
            ValueError: an empty or unrenderable prompt, ``n < 1``, a key already in flight, or an image prompt.
        """
        if prompt_images(request.prompt):  # the scheduler's rows carry no pixel inputs (yet)
            raise ValueError("the streaming HF engine does not take image prompts yet: run a vision-language model "
                             "with worker.streaming off (static batches pass the images to generate)")
        if self._stream is None:
            self._stream = StreamScheduler(self)
        self._stream.submit(key, request)

    def poll(self, timeout: float) -> list[Finished]:
        return self._stream.poll(timeout) if self._stream is not None else []

    def in_flight(self) -> int:
        return self._stream.in_flight() if self._stream is not None else 0

    def occupancy(self) -> dict[str, float]:
        out = {"busy_seq_s": self._static_busy_s, "capacity_seq_s": self._static_capacity_s}
        if self._stream is not None:
            for k, v in self._stream.occupancy().items():
                out[k] = out.get(k, 0.0) + v  # the scheduler's idle/pause split too (workers.streaming reports it)
        return out

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def decode(self, ids: Any) -> str:
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else [int(i) for i in ids]  # not int() per 0-d tensor
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # -- weights ------------------------------------------------------------------------------------

    def apply_weights(self, update: Any) -> None:
        """Loads a :class:`~asyncrl.weights.WeightUpdate`; later completions carry ``update.version``.

        Raises:
            ValueError: a version older than the current one, an unknown mode, missing/unexpected
                tensor names or mismatched shapes, a LoRA update with ``engine.lora_rank`` unset or smaller
                than the adapter's rank, or a LoRA config differing from the first one. The policy is
                unchanged then.
        """
        # equal: a reload (e.g. version 0 published at start-up); older is fine from a new incarnation (a resume)
        if update.version < self.policy_version and getattr(update, "incarnation", "") == self.incarnation:
            raise ValueError(f"weight update {update.version=} is older than the engine's {self.policy_version=}")
        if update.mode == "full":
            if not self._swap_shadow(update):
                self._apply_full(update.tensors)
        elif update.mode == "lora":
            self._apply_lora(update.tensors, update.lora_config)
        else:
            raise ValueError(f"unknown weight update mode {update.mode!r}; expected 'full' or 'lora'")
        self.policy_version = update.version
        if self._stream is not None:  # in flight: keep re-prefills the running rows, abort returns them aborted
            self._stream.weights_changed(update.version, getattr(self, "weights_in_flight", "keep"))

    def weight_checksums(self, mode: str, names: list[str]) -> dict[str, tuple[str, int] | None]:
        """``(dtype, checksum)`` of the module's own tensors: its state dict (``full``) or its peft adapter's state
        dict (``lora``; none before the first adapter is loaded)."""
        from asyncrl.weights.verify import tensor_checksum

        if mode == "lora":
            from peft import get_peft_model_state_dict

            held = get_peft_model_state_dict(self.model) if self._lora_config is not None else {}
        else:
            held = self.model.state_dict() if self._lora_config is None else {}  # an adapter renames the base
        return {n: (str(held[n].dtype).removeprefix("torch."), tensor_checksum(held[n])) for n in names if n in held}

    def shadow_weights(self) -> Any:
        """The engine's shadow weights (made on the first call, its memory touched: one more copy of the state dict).

        Raises:
            ValueError: a CUDA or 4-bit engine (the receiver fills CPU tensors it can swap byte for byte), or a
                model wrapped with a LoRA adapter (shadow the base before the first adapter update).
        """
        if self._shadow is None:
            if self.device.type != "cpu" or self.config.quantization != "none" or self._lora_config is not None:
                raise ValueError(f"weights.shadow needs the HF engine on the CPU without a 4-bit base or an adapter "
                                 f"(engine.device={self.config.device!r}, engine.quantization="
                                 f"{self.config.quantization!r}, adapter loaded: {self._lora_config is not None})")
            from asyncrl.weights.shadow import ShadowWeights

            for t in self.model.state_dict(keep_vars=True).values():  # parameters and buffers: the shadow is
                if not t.is_contiguous():  # contiguous, so must the storage it swaps with be (same values)
                    t.data = t.data.contiguous()
            self._shadow = ShadowWeights(self.model.state_dict(keep_vars=True))
        return self._shadow

    def _swap_shadow(self, update: Any) -> bool:
        """Applies a full ``update`` staged over this engine's shadow by swapping storage (the receiver checked its names,
        dtypes and shapes against the shadow's, made from this model); False if it is not one, or an adapter is loaded
        (then :meth:`_apply_full` unloads it and copies from the shadow)."""
        if self._shadow is None or self._lora_config is not None or not self._shadow.holds(update):
            return False
        try:
            self._shadow.swap_into(self.model.state_dict(keep_vars=True), update)
        except ValueError as e:  # the module's layout or ties changed since the shadow was made: copy it instead
            logger.warning("HF engine: cannot swap in the shadow weights of version %d (%s); copying them", update.version, e)
            return False
        return True

    def _apply_full(self, tensors: dict[str, torch.Tensor]) -> None:
        if self.config.quantization != "none":
            raise ValueError(f"full weight update to an engine holding a 4-bit base (engine.quantization="
                             f"{self.config.quantization}): a QLoRA engine takes lora updates only (the base is frozen)")
        # Validated against the base model's names before anything changes, adapter or not.
        self._check_names("full", set(tensors), set(self._base_shapes))
        for name, t in tensors.items():
            if (shape := tuple(t.shape)) != self._base_shapes[name]:
                raise ValueError(f"full weight update: {name} has shape {shape}, model has {self._base_shapes[name]}")
        if self._lora_config is not None:
            # A full update replaces the policy: the adapter trained on the old base weights goes with it.
            self.model = self.model.unload()
            self._lora_config = None
        target = self.model.state_dict()
        state = {name: t.to(device=target[name].device, dtype=target[name].dtype) for name, t in tensors.items()}
        self.model.load_state_dict(state, strict=True)

    def _apply_lora(self, tensors: dict[str, torch.Tensor], lora_config: dict[str, Any] | None) -> None:
        from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict

        if lora_config is None:
            raise ValueError("LoRA weight update without lora_config; publish it with lora_config=LoraConfig.to_dict()")
        peft_config = LoraConfig.from_peft_type(**{k: v for k, v in lora_config.items() if k != "peft_type"})
        if not self.config.lora_rank or peft_config.r > self.config.lora_rank:
            raise ValueError(f"LoRA update of rank {peft_config.r} needs engine.lora_rank >= {peft_config.r}, "
                             f"got {self.config.lora_rank}")
        normalised = peft_config.to_dict()
        if self._lora_config is None:
            # A fresh adapter has lora_B = 0: until its weights load, the model computes the base policy.
            self.model = get_peft_model(self.model, peft_config).eval()
            self._lora_config = normalised
        elif normalised != self._lora_config:
            changed = sorted(k for k in normalised if normalised[k] != self._lora_config.get(k))
            raise ValueError(f"LoRA config changed between updates in {changed}; restart the worker to change it")
        self._check_names("lora", set(tensors), set(get_peft_model_state_dict(self.model)))
        result = set_peft_model_state_dict(self.model, tensors)
        if result.unexpected_keys:
            raise ValueError(f"lora weight update: peft rejected {_listed(set(result.unexpected_keys))}")

    @staticmethod
    def _check_names(mode: str, got: set[str], expected: set[str]) -> None:
        missing, unexpected = expected - got, got - expected
        if missing or unexpected:
            raise ValueError(
                f"{mode} weight update does not match the model: missing {_listed(missing)}, "
                f"unexpected {_listed(unexpected)} ({len(got)} tensors sent, {len(expected)} expected)"
            )

    def close(self) -> None:
        self.model = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

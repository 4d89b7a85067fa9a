"""QLoRA: the frozen base in 4-bit NF4 (bitsandbytes), the same on the trainer and on every HF rollout engine.

::

    trainer (recipe, lora.qlora: true)              HF engine (engine.quantization: nf4)
      base = load_quantized_base(dir, dtype)          model = load_quantized_base(dir, dtype)   <- one code path
      get_peft_model(base, LoraConfig(...))           (wrapped with peft at the first LoRA update)
      trains the adapter in full precision  ──lora──► loads the adapter (policy_state mode "lora")
      checkpoints adapter + its AdamW state, and base_reference(base, dir): the base is named by hash, not copied

Why bitsandbytes and not torchao's NF4: transformers loads a bitsandbytes NF4 model through
``BitsAndBytesConfig`` in ``from_pretrained`` and peft wraps its ``Linear4bit`` layers with LoRA layers of its
own (``peft.tuners.lora.bnb``), so the trainer and the engine load the identical quantized base with one call
and train/serve LoRA on it with no code of ours in the matmul; bitsandbytes 0.50 quantizes and runs
``matmul_4bit`` on CPU. torchao 0.18 (built for torch >= 2.11, so 2.13 too) has an ``NF4Tensor`` that composes
with FSDP2, but transformers' ``TorchAoConfig`` has no NF4 scheme and peft's LoRA does not wrap an NF4Tensor
linear, so it would mean quantizing and wrapping the linears by hand on both ends; it is the route to
FSDP2 + QLoRA (:data:`FSDP2_REFUSAL`), not taken here.

Quantization is deterministic: the same weight files give the same 4-bit bytes, so the trainer and every
engine hold the same base (:func:`base_reference`'s ``quantized_sha256`` says so and is checked at resume).
Nothing here blocks or starts anything; loading reads the model directory.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import torch

from asyncrl.config.train import FSDP2_REFUSAL, VLLM_REFUSAL

__all__ = ["FSDP2_REFUSAL", "QUANT_TYPE", "VLLM_REFUSAL", "base_reference", "is_quantized",
           "load_quantized_base", "parameter_bytes", "quantization_config"]

QUANT_TYPE = "nf4"
"""The 4-bit data type of the base (bitsandbytes' NormalFloat4, block size 64, no double quantization)."""
_CHUNK = 1 << 20


def quantization_config(dtype: str = "float32") -> Any:
    """transformers' ``BitsAndBytesConfig`` of the base: NF4 weights, matmuls computed in ``dtype``."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=QUANT_TYPE,
                              bnb_4bit_compute_dtype=getattr(torch, dtype), bnb_4bit_use_double_quant=False)


def load_quantized_base(model_dir: str | os.PathLike, *, dtype: str = "float32", device: str | torch.device = "cpu",
                        ) -> torch.nn.Module:
    """The model of ``model_dir`` with its linear layers in 4-bit NF4 and everything frozen: the one function the
    trainer and the HF engine both load the QLoRA base with.

    Every ``nn.Linear`` but the output head becomes a bitsandbytes ``Linear4bit`` (transformers keeps the head in
    full precision); embeddings, norms and the head are cast to float32 (peft's
    ``prepare_model_for_kbit_training``, without gradient checkpointing), on both ends alike.

    Args:
        model_dir: an HF model directory.
        dtype: the compute dtype of the 4-bit matmuls and the dtype the rest is loaded in (``model.dtype``).
        device: where the model lives (``cpu`` or a CUDA device).
    """
    from peft import prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM

    device = torch.device(device)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), quantization_config=quantization_config(dtype),
        device_map={"": device.index if device.type == "cuda" and device.index is not None else str(device)})
    for module in model.modules():
        # bitsandbytes repacks a CPU weight for its AVX512-BF16 kernel at the first no-grad eval forward: the
        # engine would then compute with another kernel than the trainer (and hold other bytes). One kernel on both.
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def is_quantized(model: torch.nn.Module) -> bool:
    """Whether any parameter of ``model`` is a bitsandbytes 4-bit weight."""
    return any(type(p).__name__ == "Params4bit" for p in model.parameters())


def _base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The HF model inside a DDP wrapper and a peft wrapper (LoRA layers still injected)."""
    from torch.nn.parallel import DistributedDataParallel

    model = model.module if isinstance(model, DistributedDataParallel) else model
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _frozen_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The frozen state-dict tensors (quantization states included) under the bare HF model's names: a peft
    wrapper's adapter is left out and its ``.base_layer`` is not part of the names, so a base hashes alike
    before and after ``get_peft_model``."""
    model = _base_model(model)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    return {name.replace(".base_layer.", "."): t for name, t in model.state_dict().items()
            if name not in trainable and ".lora_" not in name}


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())


def _files_sha256(model_dir: Path) -> tuple[str, list[str]]:
    """sha256 over the directory's weight files (``*.safetensors``, ``*.bin``) and ``config.json``, by name."""
    files = sorted(p for p in model_dir.iterdir() if p.suffix in (".safetensors", ".bin") or p.name == "config.json")
    if not any(p.suffix in (".safetensors", ".bin") for p in files):
        raise FileNotFoundError(f"{model_dir} has no *.safetensors or *.bin weight file to reference the base by")
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode() + b"\0")
        with open(p, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
    return h.hexdigest(), [p.name for p in files]


def base_reference(model: torch.nn.Module, model_dir: str | os.PathLike) -> dict[str, Any]:
    """What a checkpoint records instead of the frozen base (:class:`asyncrl.checkpoint.Checkpointer` ``base=``).

    Returns:
        ``{"identity": {...}, "about": {...}}``: ``identity`` (compared at resume) holds ``weights_sha256`` (the
        model directory's weight files and config), ``quantization`` and ``quantized_sha256`` (the frozen tensors
        as held in memory, 4-bit bytes and their scales, under the bare model's names: the same with or without
        a peft adapter; a bitsandbytes that quantized differently would change it); ``about`` (not compared) holds
        the directory, its files and the bitsandbytes version.
    """
    import bitsandbytes

    model_dir = Path(model_dir).resolve()
    weights, files = _files_sha256(model_dir)
    held = hashlib.sha256()
    for name, t in _frozen_state(model).items():
        held.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        held.update(_tensor_bytes(t))
    return {
        "identity": {"weights_sha256": weights, "quantization": {"quant_type": QUANT_TYPE, "double_quant": False},
                     "quantized_sha256": held.hexdigest()},
        "about": {"model_dir": str(model_dir), "files": files, "bitsandbytes": bitsandbytes.__version__},
    }


def parameter_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes the model's parameters and quantization states hold: ``trainable``, ``frozen`` (of which
    ``quantized``: the 4-bit weights and their scales) and ``total``."""
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    frozen_state = _frozen_state(model)
    frozen = sum(t.numel() * t.element_size() for t in frozen_state.values())
    quantized_layers = {name.replace(".base_layer.", ".").removesuffix(".weight")
                        for name, p in _base_model(model).named_parameters() if type(p).__name__ == "Params4bit"}
    quantized = sum(t.numel() * t.element_size() for name, t in frozen_state.items()
                    if name.partition(".weight")[0] in quantized_layers)
    return {"trainable": trainable, "frozen": frozen, "quantized": quantized, "total": trainable + frozen}

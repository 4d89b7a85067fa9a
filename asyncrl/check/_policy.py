"""The policy every check stage builds, the same bits in every process, and the helpers that compare it (private).

:func:`build_policy` is the recipe's model set-up (``from_pretrained`` in the check's dtype, a peft LoRA adapter
of ``lora_rank`` on the recipe's default target modules) made deterministic: the adapter's ``lora_A`` comes from
``seed`` and its ``lora_B`` is filled from a generator (peft initialises B to zero, which would make a merged
LoRA model equal its base and hide an adapter that is lost). The single process of the ``parallel`` stage, every
rank it launches and the ``checkpoint`` and ``loss`` stages all build it this way, so "equal bit for bit" is a
meaningful claim about the wrapping (DDP, FSDP2), the checkpoint or the loss and not about the initialisation.

:func:`full_tensors` yields a module's parameters and buffers as full tensors, one at a time (an FSDP2 DTensor is
gathered by ``full_tensor()``, a collective: every rank iterates in the same order). Nothing here blocks otherwise.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["LORA_TARGETS", "QLORA_SKIP", "begin_stage", "build_policy", "digest", "first_difference", "fixed_batch", "full",
           "full_tensors", "import_all", "unwrap"]

QLORA_SKIP = ("--qlora: this stage builds the policy in full precision (a LoRA adapter over the model's own dtype); "
              "the 4-bit base of QLoRA is not covered by it yet")
"""Why ``parallel``, ``checkpoint`` and ``loss`` skip under ``--qlora`` (a skipped stage is ok, and says so)."""
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
"""The recipe's default ``lora.target_modules`` (``asyncrl.config.LoraConfig``)."""


def import_all(modules: Sequence[str]) -> None:
    """Imports ``CheckContext.imports`` (a custom architecture's registration, a test's fault) before anything else."""
    for name in modules:
        importlib.import_module(name)


def begin_stage(ctx: Any, stage: str) -> tuple[Path, Any]:
    """The prelude of the stages that build the policy in full precision (``parallel``, ``checkpoint``, ``loss``).

    Returns ``(workdir, None)`` with ``ctx.imports`` imported (a fault module patches before the stage runs) and the
    stage's directory under ``ctx.workdir`` created; under ``--qlora`` ``(workdir, skipped)`` with the stage's
    skipped :class:`~asyncrl.check.StageResult` (:data:`QLORA_SKIP`), before anything is imported or built."""
    from asyncrl.check import StageResult

    work = Path(ctx.workdir) / stage
    if ctx.qlora:
        return work, StageResult(stage=stage, ok=True, summary="skipped", skipped=QLORA_SKIP)
    import_all(ctx.imports)
    work.mkdir(parents=True, exist_ok=True)
    return work, None


def build_policy(model_dir: str, *, dtype: str = "float32", lora_rank: int = 0, seed: int = 0) -> torch.nn.Module:
    """The trained policy as the recipe builds it, deterministically (see the module docstring)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()  # a check's output is its table
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    policy.generation_config.top_k = None  # the trainer never samples (as the recipe)
    if lora_rank:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(seed)  # lora_A's init
        policy = get_peft_model(policy, LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, target_modules=LORA_TARGETS))
        gen = torch.Generator().manual_seed(seed + 7)
        with torch.no_grad():
            for name, p in policy.named_parameters():
                if "lora_B" in name:
                    p.copy_((torch.randn(p.shape, generator=gen) * 0.05).to(p.dtype))
    return policy


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside a DDP wrapper (FSDP2 wraps nothing: the module itself, its parameters DTensors)."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def full(t: torch.Tensor) -> torch.Tensor:
    """``t`` whole: a DTensor's ``full_tensor()`` (a collective), else ``t`` itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def full_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full tensor)`` of every parameter, then every buffer, of ``model`` (unwrapped), in module order."""
    inner = unwrap(model)
    for name, p in inner.named_parameters():
        yield name, full(p.detach())
    for name, b in inner.named_buffers():
        yield name, full(b)


def digest(t: torch.Tensor) -> str:
    """``dtype:shape:checksum`` of ``t``'s bytes (:func:`asyncrl.weights.verify.tensor_checksum`): equal strings are
    equal tensors bit for bit."""
    from asyncrl.weights.verify import tensor_checksum

    return f"{str(t.dtype).removeprefix('torch.')}:{list(t.shape)}:{tensor_checksum(t):016x}"


def fixed_batch(vocab_size: int, *, seed: int, rows: int = 4, length: int = 24,
                pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """A right-padded ``[rows, length]`` batch of random real tokens (rows of decreasing length), from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab_size, (rows, length), generator=gen)
    lengths = [max(2, length - 5 * r) for r in range(rows)]
    mask = torch.zeros(rows, length, dtype=torch.long)
    for r, n in enumerate(lengths):
        mask[r, :n] = 1
        ids[r, n:] = pad_token_id
    return {"input_ids": ids, "attention_mask": mask}


def first_difference(a: torch.Tensor, b: torch.Tensor) -> dict[str, Any]:
    """Where two tensors of one shape differ: max |a - b|, the first differing flat index and its dim-0 row."""
    if a.shape != b.shape:
        return {"shape": list(a.shape), "expected_shape": list(b.shape)}
    d = (a.double() - b.double()).abs().reshape(-1)
    differ = (a.reshape(-1) != b.reshape(-1)).nonzero()
    first = int(differ[0]) if differ.numel() else -1
    row = first // max(1, a[0].numel()) if a.dim() and first >= 0 else first
    return {"max_abs": float(d.max()) if d.numel() else 0.0, "differing": int(differ.numel()), "first_row": row}

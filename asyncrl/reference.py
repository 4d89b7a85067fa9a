"""The reference policy of the KL penalty (``loss.beta > 0``): frozen, never trained, published or checkpointed.

::

    trainer step:  batch ──► policy logprobs (grad) ──┐
                        └──► reference logprobs ──────┴──► compute_loss(..., ref_logprobs)  (k3 KL, logged)

As TRL builds it: a frozen copy of the initial policy (:meth:`ReferencePolicy.load`: the weights the run
started from, read from a model directory, so a resumed run gets the same reference), or, when the policy is a
peft model being trained from a fresh adapter, the policy itself with its adapters disabled
(:meth:`ReferencePolicy.of_peft`: no second copy of the base). Its logprobs use the same sampling settings
(temperature, top-k, top-p) as the trainer's, so the KL compares like with like. The trainer's step blocks in
:meth:`ReferencePolicy.logprobs` for one forward pass without gradients. Under FSDP2 each rank holds a whole
copy (the reference is small next to the optimizer state; sharding it is future work).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

from asyncrl.logprobs import token_logprobs

__all__ = ["ReferencePolicy"]


class ReferencePolicy:
    """A frozen policy whose logprobs the KL term compares with.

    Args:
        model: the reference model (frozen here), or the peft policy whose adapters are disabled for it.
        disable_adapters: True for a peft policy (``model.disable_adapter()`` around each forward).
    """

    def __init__(self, model: torch.nn.Module, *, disable_adapters: bool = False):
        self.model = model
        self.disable_adapters = disable_adapters
        if not disable_adapters:
            model.eval()
            model.requires_grad_(False)

    @classmethod
    def load(cls, path: str | Path, *, dtype: str = "float32", device: str | torch.device = "cpu") -> ReferencePolicy:
        """A frozen copy of the model saved in ``path`` (an HF directory: the run's initial policy)."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype))
        return cls(model.to(device))

    @classmethod
    def of_peft(cls, policy: torch.nn.Module) -> ReferencePolicy:
        """The base of a peft policy: its forward with the adapters disabled (TRL's reference under LoRA).

        Raises:
            TypeError: when ``policy`` has no ``disable_adapter()`` (not a peft model).
        """
        if not hasattr(policy, "disable_adapter"):
            raise TypeError(f"{type(policy).__name__} is not a peft model (no disable_adapter()); load the "
                            "reference with ReferencePolicy.load(model_dir) instead")
        return cls(policy, disable_adapters=True)

    @classmethod
    def for_run(cls, model: torch.nn.Module, policy: torch.nn.Module, *, model_dir: str | Path, run_dir: str | Path,
                lora: bool, warmed: bool, fresh: bool, dtype: str = "float32",
                device: str | torch.device = "cpu") -> ReferencePolicy:
        """A training run's reference, on every rank (collective when it saves): under LoRA the policy with its
        adapters off; else a frozen copy of the policy the run started from: ``model_dir``, or after a full warm
        start (``warmed``) the warmed policy, saved once into ``{run_dir}/model-ref`` by a ``fresh`` run (its full
        state gathered from DDP or FSDP2 ``model``), so that a resumed run loads the same reference.

        Args:
            model: the wrapped policy (DDP, FSDP2) the trainer steps.
            policy: the unwrapped HF (or peft) model.
        """
        import torch.distributed as dist

        if lora:
            return cls.of_peft(policy)
        ref_dir = Path(run_dir) / "model-ref" if warmed else Path(model_dir)
        if warmed and fresh:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            distributed = dist.is_available() and dist.is_initialized()
            if not distributed or dist.get_rank() == 0:
                policy.save_pretrained(ref_dir, state_dict={k.removeprefix("module."): v for k, v in full.items()})
            if distributed:
                dist.barrier()
        return cls.load(ref_dir, dtype=dtype, device=device)

    def logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, temperature: float = 1.0,
                 top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
        """``[B, L]`` reference logprobs of a batch, as :func:`asyncrl.logprobs.token_logprobs` (no gradient)."""
        context: Any = self.model.disable_adapter() if self.disable_adapters else contextlib.nullcontext()
        with context:
            return token_logprobs(self.model, input_ids, attention_mask, temperature=temperature, top_k=top_k,
                                  top_p=top_p, grad=False)

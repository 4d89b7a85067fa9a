"""The reference policy of the KL penalty (``loss.beta > 0``): frozen, never trained, published or checkpointed.

::

    trainer step:  batch ──► policy logprobs (grad) ──┐
                        └──► reference logprobs ──────┴──► compute_loss(..., ref_logprobs)  (k3 KL, logged)

As TRL builds it: a frozen copy of the initial policy (:meth:`ReferencePolicy.load`: the weights the run
started from, read from a model directory, so a resumed run gets the same reference), or, when the policy is a
peft model being trained from a fresh adapter, the policy itself with its adapters disabled
(:meth:`ReferencePolicy.of_peft`: no second copy of the base). Its logprobs use the same sampling settings
(temperature, top-k, top-p) as the trainer's, so the KL compares like with like. The trainer's step blocks in
:meth:`ReferencePolicy.logprobs` for one forward pass without gradients.

Under FSDP2 (``parallel="fsdp2"``) the reference is sharded like the policy (``fully_shard`` per decoder layer,
then the root), frozen, in eval mode, and resharded after every forward, the root included: each rank holds
``1/world`` of it between steps and one decoder layer (plus the root's embeddings and head) gathered during its
forward, and its logprobs are bit for bit the unsharded reference's. Its forward is then a collective: every rank
calls :meth:`ReferencePolicy.logprobs` once per step, as it calls the policy's (``tests/integration/
test_two_rank_step.py``). Under DDP each rank holds a whole copy (nothing to synchronise: it never trains).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

from asyncrl.train.logprobs import token_logprobs

__all__ = ["ReferencePolicy", "shard_frozen"]


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
    def load(cls, path: str | Path, *, dtype: str = "float32", device: str | torch.device = "cpu",
             parallel: str = "ddp") -> ReferencePolicy:
        """A frozen copy of the model saved in ``path`` (an HF directory: the run's initial policy).

        Args:
            parallel: the policy's ``train.parallel``: ``fsdp2`` shards the copy over the process group (collective:
                every rank loads it), ``ddp`` keeps a whole copy on each rank.

        Raises:
            ValueError: for another ``parallel``.
        """
        from transformers import AutoModelForCausalLM

        if parallel not in ("ddp", "fsdp2"):
            raise ValueError(f"reference for train.parallel={parallel!r}: must be 'ddp' or 'fsdp2'")
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype)).to(device)
        model.eval()
        model.requires_grad_(False)
        return cls(shard_frozen(model) if parallel == "fsdp2" else model)

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
                device: str | torch.device = "cpu", parallel: str = "ddp") -> ReferencePolicy:
        """A training run's reference, on every rank (collective when it saves): under LoRA the policy with its
        adapters off; else a frozen copy of the policy the run started from: ``model_dir``, or after a full warm
        start (``warmed``) the warmed policy, saved once into ``{run_dir}/model-ref`` by a ``fresh`` run (its full
        state gathered from DDP or FSDP2 ``model``), so that a resumed run loads the same reference.

        Args:
            model: the wrapped policy (DDP, FSDP2) the trainer steps.
            policy: the unwrapped HF (or peft) model.
            parallel: ``train.parallel``; ``fsdp2`` shards the frozen copy as the policy is (under LoRA the policy
                is the reference, sharded already).
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
        return cls.load(ref_dir, dtype=dtype, device=device, parallel=parallel)

    def logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, temperature: float = 1.0,
                 top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
        """``[B, L]`` reference logprobs of a batch, as :func:`asyncrl.train.logprobs.token_logprobs` (no gradient)."""
        context: Any = self.model.disable_adapter() if self.disable_adapters else contextlib.nullcontext()
        with context:
            return token_logprobs(self.model, input_ids, attention_mask, temperature=temperature, top_k=top_k,
                                  top_p=top_p, grad=False)


def shard_frozen(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` (frozen, on its device) sharded with FSDP2 over the default process group as
    :func:`asyncrl.train.parallel.parallelize` shards the policy, but resharded after every forward, the root too: a
    module that never runs a backward would otherwise keep the root's gathered parameters (FSDP2 leaves the root
    unsharded after forward, for the backward that follows)."""
    from torch.distributed.fsdp import fully_shard

    from asyncrl.train.parallel import decoder_layers

    for layer in decoder_layers(model):
        fully_shard(layer, reshard_after_forward=True)
    return fully_shard(model, reshard_after_forward=True)

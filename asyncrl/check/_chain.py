"""The trainer end of a check's chain: the policy, its optimizer, a real broadcaster, the engine process (private).

    Chain(ctx):  policy = from_pretrained(ctx.model) [+ peft LoRA]      (as the recipe builds it)
                 broadcaster = setup_weight_broadcaster("shm")          (the recipe's same-machine backend)
                 engine = EngineProcess(ctx, "shm", broadcaster.address)
    publish():   broadcaster.publish(policy_state(policy), v)  ──►  engine.apply(v)   (wait, apply, verify, commit)
    step(groups): one AdamW step on the groups' tokens (what one update of training does to the weights)

One chain serves every stage of a run (:func:`shared_chain`: ``structure`` reads the engine before any update,
``weight_sync`` and ``logprobs`` then publish, step and compare, each from the version the previous one left), so
a run starts one engine process; the runner closes it after the last stage (:func:`close_shared`: the engine
process is ended, the shm segments removed).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from asyncrl.check._engine import EngineProcess

__all__ = ["Chain", "check_prompts", "close_shared", "load_trainer_policy", "shared_chain"]

_SHARED: dict[int, Chain] = {}
"""The run's chain, by ``id(ctx)``."""

LR = 1e-2
"""The check's optimizer step: large enough that one update moves every logprob measurably (~0.1-0.4 on the tiny
models), so an engine one update behind cannot pass."""


def load_trainer_policy(ctx: Any) -> torch.nn.Module:
    """The trainer's policy as the recipe builds it: the model directory in ``ctx.dtype`` (``ctx.qlora``: its 4-bit
    base, :func:`asyncrl.models.qlora.load_quantized_base`), wrapped with a peft LoRA adapter of rank ``ctx.lora_rank``
    (the recipe's ``lora`` defaults: alpha 16, q/k/v/o) when asked. ``ctx.imports`` are imported first."""
    import importlib

    for module in getattr(ctx, "imports", []):
        importlib.import_module(module)
    from transformers import AutoModelForCausalLM

    torch.manual_seed(ctx.seed)
    if ctx.qlora:  # the 4-bit NF4 base the recipe and the HF engine load (asyncrl.models.qlora); the adapter: full
        from asyncrl.models.qlora import load_quantized_base

        model = load_quantized_base(ctx.model, dtype=ctx.dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(ctx.model, dtype=getattr(torch, ctx.dtype))
    if ctx.lora_rank:
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model

        from asyncrl.config import LoraConfig

        lora = LoraConfig(rank=ctx.lora_rank)
        model = get_peft_model(model, PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha,
                                                     target_modules=lora.target_modules))
    return model


def check_prompts(ctx: Any, *, offset: int = 0) -> list[dict[str, Any]]:
    """``ctx.prompts`` prompt items: arithmetic text, or the same as one user turn through the chat template."""
    from asyncrl.data.tasks import arithmetic_prompts

    items = arithmetic_prompts(ctx.prompts, seed=ctx.seed + offset)
    if ctx.chat_template:
        return [{"messages": [{"role": "user", "content": p["text"]}]} for p in items]
    return [{"text": p["text"]} for p in items]


class Chain:
    """Trainer policy + broadcaster + engine process, for one stage."""

    def __init__(self, ctx: Any, stage: str):
        from asyncrl.weights import setup_weight_broadcaster

        self.ctx = ctx
        self.dir = Path(ctx.workdir) / stage
        self.dir.mkdir(parents=True, exist_ok=True)
        self.mode = "lora" if ctx.lora_rank else "full"
        self.policy = load_trainer_policy(ctx)
        params = [p for p in self.policy.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=LR)
        self.version = 0
        self.broadcaster = setup_weight_broadcaster("shm", directory=self.dir / "weights")
        self.engine: EngineProcess | None = None
        try:
            self.engine = EngineProcess(ctx, weights_type="shm", address=self.broadcaster.address, log_dir=self.dir)
        except BaseException:
            self.close()
            raise

    def published(self) -> dict[str, torch.Tensor]:
        """The tensors a publish sends now (full state or adapter, HF/peft names), as CPU copies."""
        from asyncrl.weights.state import policy_state

        with policy_state(self.policy, self.mode) as state:
            return {name: state[name].detach().clone() for name in state}

    def publish(self) -> dict[str, Any]:
        """Publishes the policy as the next version and has the engine apply it; returns the engine's verify result."""
        from asyncrl.weights.state import policy_state

        self.version += 1
        with policy_state(self.policy, self.mode) as state:
            self.broadcaster.publish(state, self.version, mode=state.mode, lora_config=state.lora_config)
        return self.engine.apply(self.version)

    def step(self, groups: list[Any]) -> float:
        """One AdamW step of the next-token loss on the groups' tokens; returns the loss."""
        from datapipes.collate import collate_groups

        self.policy.train()
        batch = collate_groups(groups)
        ids, mask = batch["input_ids"].long(), batch["attention_mask"].long()
        labels = ids.masked_fill(mask == 0, -100)
        loss = self.policy(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.policy.eval()
        return float(loss.detach())

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        self.broadcaster.close()
        shutil.rmtree(self.dir / "weights", ignore_errors=True)

    def __enter__(self) -> Chain:  # noqa: PYI034 - not subclassed
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def shared_chain(ctx: Any) -> Chain:
    """The run's chain (made at the first call; an engine process that died is replaced by a fresh chain)."""
    chain = _SHARED.get(id(ctx))
    if chain is not None and (chain.engine is None or chain.engine.proc.poll() is not None):
        close_shared(ctx)
        chain = None
    if chain is None:
        chain = _SHARED[id(ctx)] = Chain(ctx, "chain")
    return chain


def close_shared(ctx: Any) -> None:
    """Closes the run's chain, if any (the runner, after the last stage)."""
    chain = _SHARED.pop(id(ctx), None)
    if chain is not None:
        chain.close()

"""Helpers shared by the engine tests: the trainer-side view of engine completions."""

from __future__ import annotations

from typing import Any

import torch

from asyncrl.rollout import Group, Rollout
from asyncrl.train.logprobs import token_logprobs
from asyncrl.weights.base import WeightUpdate
from datapipes.collate import collate_groups
from workers.engines.base import Completion

TOL = 1e-4
SAMPLING = dict(temperature=0.8, top_k=20, top_p=0.95)
PROMPTS = [{"text": "hello"}, {"prompt_ids": [1, 40, 41, 42]}, {"text": "The quick brown fox"}]


def load_model(model_dir: str, device: str = "cpu") -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()


def collate(completions: list[list[Completion]]) -> dict[str, Any]:
    groups = [
        Group(
            epoch=0,
            prompt_index=i,
            rollouts=[
                Rollout(
                    epoch=0,
                    prompt_index=i,
                    sample_index=s,
                    worker_id="w0",
                    policy_version=c.policy_version,
                    prompt_ids=c.prompt_ids,
                    response_ids=c.response_ids,
                    logprobs=c.logprobs,
                    finish_reason=c.finish_reason,
                )
                for s, c in enumerate(cs)
            ],
        )
        for i, cs in enumerate(completions)
    ]
    return collate_groups(groups)


def max_logprob_diff(model: torch.nn.Module, completions: list[list[Completion]], **sampling: Any) -> float:
    """max |engine logprob - trainer logprob| over all response tokens."""
    batch = collate(completions)
    ours = token_logprobs(model, batch["input_ids"], batch["attention_mask"], **sampling).cpu()
    mask = batch["loss_mask"]
    assert mask.sum() == sum(c.response_ids.numel() for cs in completions for c in cs)
    return (ours[mask] - batch["rollout_logprobs"][mask]).abs().max().item()


def lora_update(model_dir: str, version: int) -> tuple[WeightUpdate, torch.nn.Module]:
    """A LoRA update as a trainer publishes it, and the merged model it stands for."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    peft_model = get_peft_model(load_model(model_dir), config)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    tensors = {k: v.clone() for k, v in get_peft_model_state_dict(peft_model).items()}
    # As it arrives off the wire: sets become lists, enums their values.
    wire_config = {k: sorted(v) if isinstance(v, set) else getattr(v, "value", v) for k, v in config.to_dict().items()}
    update = WeightUpdate(version=version, mode="lora", tensors=tensors, lora_config=wire_config)
    return update, peft_model.merge_and_unload().eval()




def merged_with(model_dir: str, state_dict: dict[str, torch.Tensor], update: WeightUpdate) -> torch.nn.Module:
    """The model a LoRA ``update`` stands for on top of ``state_dict``: adapter merged into those weights."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    base = load_model(model_dir)
    base.load_state_dict(state_dict)
    config = LoraConfig.from_peft_type(**{k: v for k, v in update.lora_config.items() if k != "peft_type"})
    peft_model = get_peft_model(base, config)
    set_peft_model_state_dict(peft_model, update.tensors)
    return peft_model.merge_and_unload().eval()


def perturbed(model: torch.nn.Module, scale: float = 0.05, seed: int = 0) -> dict[str, torch.Tensor]:
    """The model's state dict plus small deterministic noise: 'the next policy version'."""
    gen = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()}

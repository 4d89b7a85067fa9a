"""``collate_groups``: a list of groups → one padded ``TrainBatch`` of tensors.

Rows are the rollouts of the groups in order (group ``g``'s ``n`` rollouts are rows ``g*n..g*n+n-1``).
Each row is ``prompt_ids + response_ids``, right-padded. Masks and per-token values are aligned to
``input_ids`` positions: ``rollout_logprobs[b, t]`` is the rollout-side logprob of ``input_ids[b, t]``
(so a trainer compares it with ``log_softmax(logits[b, t-1])[input_ids[b, t]]``), and
``loss_mask[b, t]`` is True exactly at generated response tokens. ``reward_components`` holds each reward
component per row (NaN where a rollout lacks it), for the recipe's per-function reward means.
"""

from __future__ import annotations

from typing import Any

import torch

from asyncrl.rollout import Group

__all__ = ["TrainBatch", "collate_groups"]

TrainBatch = dict[str, Any]


def collate_groups(groups: list[Group], pad_token_id: int = 0) -> TrainBatch:
    rollouts = [r for g in groups for r in g.rollouts]
    if not rollouts:
        raise ValueError("cannot collate an empty list of groups")
    lengths = [r.num_tokens for r in rollouts]
    rows, width = len(rollouts), max(lengths)
    input_ids = torch.full((rows, width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((rows, width), dtype=torch.bool)
    loss_mask = torch.zeros((rows, width), dtype=torch.bool)
    logprobs = torch.zeros((rows, width), dtype=torch.float32)
    token_versions = torch.full((rows, width), -1, dtype=torch.long)
    for b, r in enumerate(rollouts):
        p, n = int(r.prompt_ids.numel()), int(r.response_ids.numel())
        input_ids[b, :p] = r.prompt_ids
        input_ids[b, p : p + n] = r.response_ids
        attention_mask[b, : p + n] = True
        loss_mask[b, p : p + n] = True if r.loss_mask is None else r.loss_mask
        logprobs[b, p : p + n] = r.logprobs
        for version, start, end in r.spans():
            token_versions[b, p + start : p + end] = version
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "loss_mask": loss_mask,
        "rollout_logprobs": logprobs,
        "token_versions": token_versions,
        "rewards": torch.tensor([r.reward for r in rollouts], dtype=torch.float32),
        "reward_components": _components(rollouts),
        "policy_versions": torch.tensor([r.policy_version for r in rollouts], dtype=torch.long),
        "group_index": torch.tensor([g for g, grp in enumerate(groups) for _ in grp.rollouts], dtype=torch.long),
        "prompt_lengths": torch.tensor([int(r.prompt_ids.numel()) for r in rollouts], dtype=torch.long),
        "response_lengths": torch.tensor([int(r.response_ids.numel()) for r in rollouts], dtype=torch.long),
        "generate_s": torch.tensor([r.timings.get("generate", 0.0) for r in rollouts], dtype=torch.float32),
        "group_ids": [g.group_id for g in groups],
        "uids": [r.uid for r in rollouts],
        "worker_ids": [r.worker_id for r in rollouts],
        "finish_reasons": [r.finish_reason for r in rollouts],
        "num_tokens": sum(lengths),
    }


def _components(rollouts: list) -> dict[str, torch.Tensor]:
    """``name -> [B]`` float32 of each reward component (``asyncrl.rewards``: one per reward function, plus
    extras), NaN in rows that do not have it (a function that returned None for them)."""
    names = sorted({k for r in rollouts for k in r.reward_components})
    return {k: torch.tensor([r.reward_components.get(k, float("nan")) for r in rollouts], dtype=torch.float32)
            for k in names}

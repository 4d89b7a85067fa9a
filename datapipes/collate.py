"""``collate_groups``: a list of groups → one padded ``TrainBatch`` of tensors.

Rows are the rollouts of the groups in order (group ``g``'s ``n`` rollouts are rows ``g*n..g*n+n-1``).
Each row is ``prompt_ids + response_ids``, right-padded. Masks and per-token values are aligned to
``input_ids`` positions: ``rollout_logprobs[b, t]`` is the rollout-side logprob of ``input_ids[b, t]``
(so a trainer compares it with ``log_softmax(logits[b, t-1])[input_ids[b, t]]``), and
``loss_mask[b, t]`` is True exactly at generated response tokens. ``reward_components`` holds each reward
component per row (NaN where a rollout lacks it), for the recipe's per-function reward means.

``sampling`` is what the batch's rollouts were sampled with (temperature, top-k, top-p, as their workers
reported): the trainer's logprobs must be computed under the same distribution, and
:func:`asyncrl.train.logprobs.batch_logprobs` takes them from here. A batch whose rollouts disagree (workers
configured differently) carries the list of distinct settings instead, which that helper refuses.
"""

from __future__ import annotations

import hashlib
from typing import Any, NotRequired, TypedDict

import torch

from asyncrl.rollout import Group

__all__ = ["SamplingSettings", "TrainBatch", "collate_groups"]


class SamplingSettings(TypedDict):
    """The distribution a rollout's tokens were sampled from (``EngineConfig``'s fields of the same names)."""

    temperature: float
    top_k: int
    top_p: float


class TrainBatch(TypedDict):
    """One padded batch of whole groups; ``[B, L]`` tensors are aligned to ``input_ids`` positions."""

    input_ids: torch.Tensor
    """long ``[B, L]``: prompt + response per row, right-padded."""
    attention_mask: torch.Tensor
    """bool ``[B, L]``: real tokens."""
    loss_mask: torch.Tensor
    """bool ``[B, L]``: generated response tokens (environment tokens of multi-turn rollouts are False)."""
    rollout_logprobs: torch.Tensor
    """float32 ``[B, L]``: the engine's logprob of each response token under ``sampling``."""
    token_versions: torch.Tensor
    """long ``[B, L]``: the policy version that produced each response token; -1 elsewhere."""
    rewards: torch.Tensor
    """float32 ``[B]``."""
    reward_components: dict[str, torch.Tensor]
    """name -> float32 ``[B]`` of each reward component (NaN where a rollout lacks it)."""
    policy_versions: torch.Tensor
    """long ``[B]``: each rollout's oldest policy version (its staleness is measured from it)."""
    group_index: torch.Tensor
    """long ``[B]``: the row's group, ``0..groups-1``."""
    prompt_lengths: torch.Tensor
    """long ``[B]``."""
    response_lengths: torch.Tensor
    """long ``[B]``."""
    generate_s: torch.Tensor
    """float32 ``[B]``: generation seconds per rollout."""
    sampling: SamplingSettings | list[SamplingSettings] | None
    """The settings every row was sampled with; a list of the distinct ones if rows disagree; None if no
    rollout reported them (older senders)."""
    group_ids: list[str]
    uids: list[str]
    worker_ids: list[str]
    finish_reasons: list[str]
    num_tokens: int
    """Real tokens in the batch."""
    images: NotRequired[list[list[bytes]]]
    """Only in a batch with image prompts: per row, the encoded images its engine was given (``Rollout.images``);
    :func:`asyncrl.train.logprobs.batch_logprobs` re-runs the model's processor on them."""
    image_sha256: NotRequired[list[list[str]]]
    """Only with ``images``: per row, each image's SHA-256 (provenance, as in the rollout's ``metadata``)."""


def collate_groups(groups: list[Group], pad_token_id: int = 0) -> TrainBatch:
    rollouts = [r for g in groups for r in g.rollouts]
    if not rollouts:
        raise ValueError("cannot collate an empty list of groups")
    prompt_lengths = [int(r.prompt_ids.numel()) for r in rollouts]
    response_lengths = [int(r.response_ids.numel()) for r in rollouts]
    lengths = [p + n for p, n in zip(prompt_lengths, response_lengths)]
    rows, width = len(rollouts), max(lengths)
    # each per-token field in one masked assignment of all rows' values (row-major: a row's tokens in order), not
    # one slice assignment per row and field: the batch is built while the trainer waits for it
    p_col, total_col = torch.tensor(prompt_lengths)[:, None], torch.tensor(lengths)[:, None]
    position = torch.arange(width)[None, :]
    attention_mask = position < total_col
    response = attention_mask & (position >= p_col)
    input_ids = torch.full((rows, width), pad_token_id, dtype=torch.long)
    input_ids[attention_mask] = torch.cat([t for r in rollouts for t in (r.prompt_ids, r.response_ids)]).long()
    if all(r.loss_mask is None for r in rollouts):
        loss_mask = response.clone()
    else:
        loss_mask = torch.zeros((rows, width), dtype=torch.bool)
        loss_mask[response] = torch.cat([torch.ones(n, dtype=torch.bool) if r.loss_mask is None else
                                         r.loss_mask.reshape(n).bool() for r, n in zip(rollouts, response_lengths)])
    logprobs = torch.zeros((rows, width), dtype=torch.float32)
    logprobs[response] = torch.cat([r.logprobs.reshape(n) for r, n in zip(rollouts, response_lengths)]).float()
    token_versions = torch.full((rows, width), -1, dtype=torch.long)
    token_versions[response] = _response_versions(rollouts, response_lengths)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "loss_mask": loss_mask,
        "rollout_logprobs": logprobs,
        "token_versions": token_versions,
        "rewards": torch.tensor([r.reward for r in rollouts], dtype=torch.float32),
        "reward_components": _components(rollouts),
        "sampling": _sampling(rollouts),
        "policy_versions": torch.tensor([r.policy_version for r in rollouts], dtype=torch.long),
        "group_index": torch.tensor([g for g, grp in enumerate(groups) for _ in grp.rollouts], dtype=torch.long),
        "prompt_lengths": torch.tensor(prompt_lengths, dtype=torch.long),
        "response_lengths": torch.tensor(response_lengths, dtype=torch.long),
        "generate_s": torch.tensor([r.timings.get("generate", 0.0) for r in rollouts], dtype=torch.float32),
        "group_ids": [g.group_id for g in groups],
        "uids": [r.uid for r in rollouts],
        "worker_ids": [r.worker_id for r in rollouts],
        "finish_reasons": [r.finish_reason for r in rollouts],
        "num_tokens": sum(lengths),
        **_images(rollouts),
    }


def _response_versions(rollouts: list, response_lengths: list[int]) -> torch.Tensor:
    """Every row's response tokens' policy versions, rows concatenated: each rollout's version spans written in
    order into its own stretch (a slice of it: clipped to the response, later spans win where they overlap), -1 in
    gaps between them."""
    out = torch.full((sum(response_lengths),), -1, dtype=torch.long)
    offset = 0
    for r, n in zip(rollouts, response_lengths):
        row = out[offset : offset + n]
        for version, start, end in r.spans():
            row[start:end] = version
        offset += n
    return out


def _images(rollouts: list) -> dict[str, Any]:
    """``images`` and ``image_sha256`` per row, for a batch with at least one image prompt; else nothing."""
    if not any(r.images for r in rollouts):
        return {}
    return {"images": [list(r.images) for r in rollouts],
            "image_sha256": [[hashlib.sha256(x).hexdigest() for x in r.images] for r in rollouts]}


def _components(rollouts: list) -> dict[str, torch.Tensor]:
    """``name -> [B]`` float32 of each reward component (``asyncrl.rewards.reward_set``: one per reward function, plus
    extras), NaN in rows that do not have it (a function that returned None for them)."""
    names = sorted({k for r in rollouts for k in r.reward_components})
    return {k: torch.tensor([r.reward_components.get(k, float("nan")) for r in rollouts], dtype=torch.float32)
            for k in names}


def _sampling(rollouts: list) -> SamplingSettings | list[SamplingSettings] | None:
    """The one setting of the rows, the distinct ones if they differ (a row that reports none counts as one)."""
    distinct: list[Any] = []
    for r in rollouts:
        if r.sampling not in distinct:
            distinct.append(r.sampling)
    if len(distinct) == 1:
        return None if distinct[0] is None else SamplingSettings(**distinct[0])
    return [SamplingSettings(**d) if d is not None else None for d in distinct]

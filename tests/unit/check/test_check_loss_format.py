"""The loss stage's data-format checks (asyncrl.check.loss) on hand-built rollouts: a healthy collated batch has no
offenders; a loss mask over a prompt token, an attention mask over padding and a finished row's padding kept as
response tokens are each named; equal infinities (prompt tokens outside top-k) compare equal."""

from __future__ import annotations

import math

import torch

from asyncrl.check.loss import _abs_diff, _format
from asyncrl.rollout import Group, Rollout
from datapipes.collate import collate_groups

PAD, EOS = 0, 2


def _groups(responses: list[list[int]]) -> list[Group]:
    rollouts = [Rollout(epoch=0, prompt_index=0, sample_index=s, worker_id="w", policy_version=0,
                        prompt_ids=torch.tensor([5, 6, 7][: 2 + s % 2], dtype=torch.int32),
                        response_ids=torch.tensor(r, dtype=torch.int32), logprobs=-torch.ones(len(r)),
                        finish_reason="stop" if r and r[-1] == EOS else "length")
                for s, r in enumerate(responses)]
    return [Group(epoch=0, prompt_index=0, rollouts=rollouts)]


def test_a_healthy_batch_has_no_offenders():
    groups = _groups([[9, 10, EOS], [11, 12, 13, 14]])
    assert _format(collate_groups(groups, pad_token_id=PAD), groups, PAD, {EOS}) == []


def test_each_layout_fault_is_named():
    groups = _groups([[9, 10, EOS], [11, 12, 13, 14]])
    batch = collate_groups(groups, pad_token_id=PAD)
    batch["loss_mask"][0, 1] = True  # a prompt token in the loss
    batch["attention_mask"][0, -1] = True  # attention over padding
    found = {o["name"]: o["what"] for o in _format(batch, groups, PAD, {EOS})}
    assert "covers prompt positions" in found["loss_mask"] and "not exactly the real tokens" in found["attention_mask"]


def test_padding_after_eos_inside_a_response_is_named():
    groups = _groups([[9, EOS, PAD, PAD], [11, 12, 13, 14]])  # generate's padding of a finished row kept
    found = _format(collate_groups(groups, pad_token_id=PAD), groups, PAD, {EOS})
    assert [o["name"] for o in found] == ["response_ids"] and "2 tokens after the eos" in found[0]["what"]


def test_equal_infinities_are_equal_and_one_sided_ones_are_not():
    a = torch.tensor([-math.inf, -1.0, -math.inf, -2.0])
    b = torch.tensor([-math.inf, -1.5, -1.0, -2.0])
    assert _abs_diff(a, b).tolist() == [0.0, 0.5, math.inf, 0.0]

"""``collate_groups`` builds every per-token field in one masked assignment over all rows; these check it against
the definition, row by row (``prompt + response`` right-padded, masks and values at response positions, version
spans with -1 in gaps), over random batches: empty responses, loss masks on some rows only, several spans."""

from __future__ import annotations

import random

import pytest
import torch

from asyncrl.rollout import Group, Rollout
from datapipes.collate import collate_groups


def _rollout(rng: random.Random, prompt_index: int, sample: int, *, spans: bool, masks: bool) -> Rollout:
    p, n = rng.randint(1, 6), rng.randint(0, 7)
    version_spans: list[tuple[int, int, int]] = []
    if spans and n:
        cuts = sorted(rng.sample(range(n + 1), k=min(n + 1, 3)))
        version_spans = [(rng.randint(0, 5), a, b) for a, b in zip(cuts, cuts[1:]) if b > a and rng.random() < 0.8]
    loss_mask = torch.tensor([rng.random() < 0.7 for _ in range(n)]) if masks and rng.random() < 0.5 else None
    return Rollout(epoch=0, prompt_index=prompt_index, sample_index=sample, worker_id="w", policy_version=7,
                   version_spans=version_spans, prompt_ids=torch.randint(1, 50, (p,)),
                   response_ids=torch.randint(1, 50, (n,)), logprobs=-torch.rand(n), loss_mask=loss_mask,
                   reward=rng.random(), finish_reason="stop")


def _expected(rollouts: list[Rollout], pad: int) -> dict[str, torch.Tensor]:
    width = max(r.num_tokens for r in rollouts)
    out = {"input_ids": torch.full((len(rollouts), width), pad, dtype=torch.long),
           "attention_mask": torch.zeros((len(rollouts), width), dtype=torch.bool),
           "loss_mask": torch.zeros((len(rollouts), width), dtype=torch.bool),
           "rollout_logprobs": torch.zeros((len(rollouts), width)),
           "token_versions": torch.full((len(rollouts), width), -1, dtype=torch.long)}
    for b, r in enumerate(rollouts):
        p, n = r.prompt_ids.numel(), r.response_ids.numel()
        out["input_ids"][b, :p + n] = torch.cat([r.prompt_ids, r.response_ids])
        out["attention_mask"][b, :p + n] = True
        out["loss_mask"][b, p:p + n] = True if r.loss_mask is None else r.loss_mask
        out["rollout_logprobs"][b, p:p + n] = r.logprobs
        for version, start, end in r.spans():
            out["token_versions"][b, p + start:p + end] = version
    return out


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("spans,masks", [(False, False), (True, False), (False, True), (True, True)])
def test_every_per_token_field_matches_the_row_by_row_definition(seed, spans, masks):
    rng = random.Random(seed)
    groups = [Group(epoch=0, prompt_index=g, rollouts=[_rollout(rng, g, s, spans=spans, masks=masks) for s in range(3)])
              for g in range(rng.randint(1, 4))]
    rollouts = [r for g in groups for r in g.rollouts]
    if max(r.num_tokens for r in rollouts) == 0:
        pytest.skip("nothing to collate")
    batch = collate_groups(groups, pad_token_id=3)
    for key, want in _expected(rollouts, pad=3).items():
        assert batch[key].dtype == want.dtype, key
        assert torch.equal(batch[key], want), key
    assert batch["prompt_lengths"].tolist() == [r.prompt_ids.numel() for r in rollouts]
    assert batch["response_lengths"].tolist() == [r.response_ids.numel() for r in rollouts]
    assert batch["num_tokens"] == sum(r.num_tokens for r in rollouts)


def test_overlapping_spans_are_written_in_order_later_ones_winning():
    r = Rollout(epoch=0, prompt_index=0, sample_index=0, worker_id="w", policy_version=1,
                version_spans=[(1, 0, 4), (2, 2, 3), (3, 5, 9)], prompt_ids=torch.tensor([5, 6]),
                response_ids=torch.arange(1, 7), logprobs=torch.zeros(6), finish_reason="stop")
    batch = collate_groups([Group(epoch=0, prompt_index=0, rollouts=[r])])
    assert batch["token_versions"].tolist() == [[-1, -1, 1, 1, 2, 1, -1, 3]]

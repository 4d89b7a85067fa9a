"""Sampling settings travel with the rollouts into the TrainBatch, and the trainer's logprobs take them from
there (asyncrl.train.logprobs.batch_logprobs): a mixed batch, a batch that disagrees with the trainer's config, and
forged settings on the wire are refused with the values in the message."""

from __future__ import annotations

import tempfile

import pytest
import torch

from asyncrl.codec import DecodeError
from asyncrl.rollout import Group, Rollout
from asyncrl.train.logprobs import batch_logprobs, batch_sampling, token_logprobs
from datapipes.collate import collate_groups
from tests.unit.test_rollout import make_rollout, over_wire

HOT = {"temperature": 0.7, "top_k": 5, "top_p": 0.9}
PLAIN = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}


def _group(prompt_index: int, sampling: dict | None, n: int = 2) -> Group:
    rollouts = [make_rollout(prompt_index=prompt_index, sample_index=i, sampling=sampling, prompt_len=3,
                             response_len=4, version_spans=[]) for i in range(n)]
    return Group(epoch=1, prompt_index=prompt_index, rollouts=rollouts)


def test_sampling_survives_the_wire_and_an_older_sender_omits_it():
    r = make_rollout(sampling=HOT)
    assert Rollout.from_wire(over_wire(r.to_wire())).sampling == HOT
    wire = make_rollout().to_wire()
    assert "sampling" not in wire and Rollout.from_wire(over_wire(wire)).sampling is None


@pytest.mark.parametrize("bad, match", [
    ({"temperature": 0.0, "top_k": 0, "top_p": 1.0}, "temperature=0.0 > 0"),
    ({"temperature": 1.0, "top_k": -1, "top_p": 1.0}, "top_k=-1"),
    ({"temperature": 1.0, "top_k": 0, "top_p": 1.5}, "top_p=1.5"),
    ({"temperature": float("nan"), "top_k": 0, "top_p": 1.0}, "finite"),
    ({"temperature": 1.0, "top_k": 0}, "exactly"),
])
def test_forged_sampling_is_refused(bad, match):
    wire = make_rollout().to_wire() | {"sampling": bad}
    with pytest.raises(DecodeError, match=match):
        Rollout.from_wire(over_wire(wire))


def test_the_batch_carries_one_setting_or_the_distinct_ones():
    assert collate_groups([_group(0, HOT), _group(1, HOT)])["sampling"] == HOT
    assert collate_groups([_group(0, None)])["sampling"] is None
    assert collate_groups([_group(0, HOT), _group(1, PLAIN)])["sampling"] == [HOT, PLAIN]


def test_batch_logprobs_use_the_batchs_settings():
    from transformers import AutoModelForCausalLM

    from asyncrl.testing.tiny_model import build_tiny_model

    batch = collate_groups([_group(0, HOT)])
    batch["input_ids"] = batch["input_ids"] % 16  # inside the tiny model's vocabulary
    with tempfile.TemporaryDirectory() as d:
        model = AutoModelForCausalLM.from_pretrained(build_tiny_model(d))
    got = batch_logprobs(model, batch)
    want = token_logprobs(model, batch["input_ids"], batch["attention_mask"], **HOT)
    plain = token_logprobs(model, batch["input_ids"], batch["attention_mask"])
    assert torch.equal(got, want) and not torch.equal(got, plain)


def test_mixed_conflicting_or_unknown_settings_are_refused():
    with pytest.raises(ValueError, match="mixes sampling settings"):
        batch_sampling(collate_groups([_group(0, HOT), _group(1, PLAIN)]))
    with pytest.raises(ValueError, match="sampled with .*'temperature': 0.7.* but the trainer expects"):
        batch_sampling(collate_groups([_group(0, HOT)]), expected=PLAIN)
    with pytest.raises(ValueError, match="does not say what its rollouts were sampled with"):
        batch_sampling(collate_groups([_group(0, None)]))
    assert batch_sampling(collate_groups([_group(0, None)]), expected=PLAIN) == PLAIN
    assert batch_sampling(collate_groups([_group(0, HOT)]), expected=dict(HOT)) == HOT

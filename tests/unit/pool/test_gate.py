"""The gate's ranges (asyncrl.pool.gate) and the ledger's lease holders (who may deliver a prompt's group)."""

from __future__ import annotations

import pytest
import torch

from asyncrl.config import GateConfig
from asyncrl.pool.gate import GateError, check_group
from asyncrl.pool.ledger import PromptLedger
from asyncrl.rollout import Group, Rollout


def _group(*, reward=0.5, components=None, prompt_ids=(1, 2), response_ids=(3, 4), logprobs=(-0.5, -0.1)) -> Group:
    r = Rollout(
        epoch=0,
        prompt_index=7,
        sample_index=0,
        worker_id="w",
        policy_version=0,
        prompt_ids=torch.tensor(prompt_ids, dtype=torch.int64),
        response_ids=torch.tensor(response_ids, dtype=torch.int64),
        logprobs=torch.tensor(logprobs, dtype=torch.float32),
        reward=reward,
        reward_components=components or {},
    )
    return Group(epoch=0, prompt_index=7, rollouts=[r])


def test_a_healthy_group_passes():
    check_group(_group(), GateConfig(vocab_size=5))
    check_group(_group(logprobs=(0.0, -9999.0), reward=-1e6), GateConfig())


@pytest.mark.parametrize(
    "group, gate, reason",
    [
        (_group(reward=1e39), GateConfig(max_abs_reward=1e300), "reward_not_finite_float32"),  # inf once collated
        (_group(reward=3.5e38), GateConfig(max_abs_reward=1e300), "reward_not_finite_float32"),
        (_group(reward=2e6), GateConfig(), "reward_out_of_range"),
        (_group(components={"format": -1e39}), GateConfig(), "reward_not_finite_float32"),
        (_group(prompt_ids=(1, 2147483647)), GateConfig(vocab_size=32000), "token_id_out_of_range"),
        (_group(prompt_ids=(1, 2**31)), GateConfig(), "token_id_out_of_range"),  # even with no vocabulary set
        (_group(response_ids=(3, -5)), GateConfig(), "token_id_out_of_range"),
        (_group(response_ids=(3, 5)), GateConfig(vocab_size=5), "token_id_out_of_range"),
        (_group(logprobs=(-1e30, -0.1)), GateConfig(), "logprob_out_of_range"),
        (_group(logprobs=(-0.5, 0.01)), GateConfig(), "logprob_out_of_range"),
    ],
)
def test_out_of_range_values_are_named(group: Group, gate: GateConfig, reason: str):
    with pytest.raises(GateError) as e:
        check_group(group, gate)
    assert e.value.reason == reason and e.value.uid == "e0-p7-s0"
    assert "gate." in str(e.value) or "float32" in str(e.value)


def test_gate_config_checks_its_fields():
    with pytest.raises(ValueError, match="vocab_size"):
        GateConfig(vocab_size=0)
    with pytest.raises(ValueError, match="min_logprob"):
        GateConfig(min_logprob=1.0)


def test_lease_holders_are_per_prompt_and_reset_with_the_epoch():
    ledger = PromptLedger(4, shuffle=False)
    a = ledger.lease("a", now=0.0)
    assert ledger.held_by(a.prompt_index, "a") and not ledger.held_by(a.prompt_index, "b")
    assert not ledger.held_by(a.prompt_index + 1, "a")  # another prompt: never leased to it
    ledger.expire(now=1e9)  # re-issued to b: a held it, so its late group still counts
    b = ledger.lease("b", now=0.0)
    assert b.prompt_index == a.prompt_index
    assert ledger.held_by(a.prompt_index, "a") and ledger.held_by(a.prompt_index, "b")
    ledger.start_epoch(1)
    assert not ledger.held_by(a.prompt_index, "a")


def test_an_undelivered_lease_is_not_a_regeneration():
    ledger = PromptLedger(4, shuffle=False)
    first = ledger.lease("ghost", now=0.0)
    for _ in range(100):  # a peer whose sends keep failing: grant, take back, grant again
        ledger.undeliver(ledger.lease("ghost", now=0.0).lease_id)
    assert ledger.counters["regenerated"] == 0
    ledger.undeliver(first.lease_id)
    assert not ledger.held_by(first.prompt_index, "ghost")
    again = ledger.lease("w", now=0.0)
    assert again.prompt_index == first.prompt_index and again.attempt == 0  # first in line, still a first issue
    assert ledger.counters["regenerated"] == 0 and ledger.counters["leased"] == 1

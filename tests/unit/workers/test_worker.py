"""The worker loop in-process, with small fakes of the channel ends (sender, weight receiver) and
the real HF engine: partial rollouts across a weight update, multi-turn environments, rewards."""

from __future__ import annotations

import asyncio

import pytest
import torch

from asyncrl.config import HFEngineConfig
from asyncrl.rewards.legacy import arithmetic_reward, call_reward, fake_reward
from asyncrl.testing.tiny_model import build_tiny_model
from asyncrl.train.logprobs import token_logprobs
from asyncrl.transport import ReceivedLease
from asyncrl.weights import WeightUpdate
from tests.engine_utils import SAMPLING, TOL, load_model, perturbed
from tests.utils import FakeSender
from workers.engines import Completion, build_engine
from workers.environments import ArithmeticRetryEnv
from workers.worker import RolloutWorker


class FakeWeights:
    """Hands out one staged update on the ``after``-th poll."""

    def __init__(self, update: WeightUpdate | None, after: int = 1):
        self.update, self.after, self.polls, self.committed = update, after, 0, []

    def poll(self):
        self.polls += 1
        if self.update is not None and self.polls >= self.after:
            update, self.update = self.update, None
            return update
        return None

    def commit(self, version):
        self.committed.append(version)

    def stats(self):
        return {"failures": 0}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("worker") / "tiny"))


def _leases(n: int, group_size: int = 3) -> list[ReceivedLease]:
    return [
        ReceivedLease(conn=0, lease_id=i + 1, epoch=0, prompt_index=i, group_size=group_size,
                      prompt={"text": f"{i}+{i}=", "answer": str(2 * i)}, policy_version=0)
        for i in range(n)
    ]


def _logprobs(model, prompt_ids, response_ids) -> torch.Tensor:
    ids = torch.cat([prompt_ids, response_ids]).long()[None]
    out = token_logprobs(model, ids, torch.ones_like(ids), **SAMPLING)[0]
    return out[prompt_ids.numel():]


def test_partial_rollouts_keep_tokens_and_carry_version_spans(model_dir):
    engine = build_engine(HFEngineConfig(model=model_dir, max_new_tokens=12, stop_token_ids=[], **SAMPLING))
    engine.stop_ids = [10**6]  # never stop early: every response spans the update
    v0 = load_model(model_dir)
    v1_state = perturbed(v0, scale=0.1, seed=1)
    v1 = load_model(model_dir)
    v1.load_state_dict(v1_state)
    weights = FakeWeights(WeightUpdate(version=1, mode="full", tensors=v1_state), after=1)
    sender = FakeSender()
    worker = RolloutWorker("w0", engine, fake_reward, sender, max_batch=2, weights=weights, interrupt_every_tokens=4)
    worker.step(_leases(2))
    assert weights.committed == [1] and not sender.failed
    for _, group in sender.groups:
        for r in group.rollouts:
            assert r.version_spans == [(0, 0, 4), (1, 4, 12)] and r.policy_version == 0
            lp0 = _logprobs(v0, r.prompt_ids, r.response_ids)
            lp1 = _logprobs(v1, r.prompt_ids, r.response_ids)
            assert (lp0[:4] - r.logprobs[:4]).abs().max() <= TOL
            assert (lp1[4:] - r.logprobs[4:]).abs().max() <= TOL
            assert (lp0[4:] - r.logprobs[4:]).abs().max() > 10 * TOL


def test_multi_turn_environment_masks_environment_tokens(model_dir):
    engine = build_engine(HFEngineConfig(model=model_dir, max_new_tokens=6, **SAMPLING))
    model = load_model(model_dir)
    sender = FakeSender()
    worker = RolloutWorker("w0", engine, fake_reward, sender, max_batch=2, environment=ArithmeticRetryEnv)
    worker.step(_leases(2, group_size=2))
    feedback = engine.encode(" no, again:")
    seen_feedback = 0
    for _, group in sender.groups:
        for r in group.rollouts:
            mask = r.loss_mask
            assert mask is not None and mask.numel() == r.response_ids.numel()
            env_positions = (~mask).nonzero().flatten().tolist()
            if env_positions:  # a second turn happened: the feedback tokens are exactly the masked ones
                seen_feedback += 1
                assert r.response_ids[env_positions].tolist() == feedback
                assert (r.logprobs[~mask] == 0).all()
            lp = _logprobs(model, r.prompt_ids, r.response_ids)
            assert (lp[mask] - r.logprobs[mask]).abs().max() <= TOL
            assert r.reward in (0.0, 0.5, 1.0)
    assert seen_feedback > 0, "the untrained model should get at least one answer wrong"


def test_rewards_sync_async_and_bad_values(model_dir):
    c = Completion(prompt_ids=torch.tensor([1]), response_ids=torch.tensor([5, 6]), logprobs=torch.zeros(2),
                   finish_reason="stop", policy_version=0, text="12")
    values = arithmetic_reward([{"answer": "12"}, {"answer": "13"}, {"answer": "99"}], [c, c, c])
    assert [v["reward"] for v in values] == [1.0, 0.25, 0.0]  # "13": half the digits right -> 0.5 * 0.5

    async def judge(prompts, completions):
        await asyncio.sleep(0)
        return [0.25] * len(completions)

    assert call_reward(judge, [{}], [c]) == [0.25]
    with pytest.raises(ValueError, match="returned 2 values for 1"):
        call_reward(lambda p, cs: [0.0, 0.0], [{}], [c])

    engine = build_engine(HFEngineConfig(model=model_dir, max_new_tokens=4, **SAMPLING))
    sender = FakeSender()
    RolloutWorker("w0", engine, lambda p, cs: [float("nan")] * len(cs), sender, max_batch=1).step(_leases(1))
    assert not sender.groups and len(sender.failed) == 1 and "non-finite" in sender.failed[0][1]


def test_every_rollout_says_what_it_was_sampled_with(model_dir):
    """The trainer's logprobs take temperature/top-k/top-p from the batch (asyncrl.train.logprobs.batch_logprobs)."""
    engine = build_engine(HFEngineConfig(model=model_dir, max_new_tokens=4, **SAMPLING))
    sender = FakeSender()
    RolloutWorker("w0", engine, fake_reward, sender, max_batch=2).step(_leases(2, group_size=2))
    want = {k: SAMPLING[k] for k in ("temperature", "top_k", "top_p")}
    assert [r.sampling for _, g in sender.groups for r in g.rollouts] == [want] * 4

"""The recipe with the GRPO family and user losses, under torchrun (real HF workers, real weight sync):
``loss.beta > 0`` trains against a built reference model and logs the KL; weighted reward lists log each
function's mean and add up; a user ``loss.fn`` goes through the update guard (its NaN is rejected and the
parameters and optimizer state stay bit for bit)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.integration.test_recipe import SMALL, _finish, _flatten, _metrics, _torchrun

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.extended
def test_beta_trains_against_a_reference_model_and_logs_kl_and_reward_components(tmp_path):
    run = tmp_path / "run"
    overrides = ["checkpoint.every=0", *SMALL, "loss.beta=0.05", "loss.loss_type=dapo",
                 "rollout.worker.reward.funcs=[arithmetic, format]", "rollout.worker.reward.weights=[1.0, 0.5]",
                 "loss.multi_objective_aggregation=normalize_then_sum"]  # per-function advantages (TRL)
    _finish(_torchrun(run, "train.steps=4", *overrides))
    rows = _metrics(run)
    assert len(rows) == 4 and all(r["accepted"] for r in rows), [r["guard_reason"] for r in rows]
    assert (run / "model-ref" / "config.json").exists()  # the warmed policy, saved once as the reference
    # step 1 trains the policy the reference copies: KL 0 (same weights, same forward); then it moves away
    assert abs(rows[0]["kl"]) < 1e-6 and rows[0]["loss/kl"] == rows[0]["kl"]
    assert all(math.isfinite(r["kl"]) and r["kl"] >= 0 for r in rows) and max(r["kl"] for r in rows[1:]) > 0
    for r in rows:  # every row is scored by both: the reward is their weighted sum, over both ranks
        assert r["reward_mean"] == pytest.approx(r["rewards/arithmetic/mean"] + 0.5 * r["rewards/format/mean"])
        assert "rewards/exact/mean" in r  # arithmetic's extra components
    # a resumed run keeps the run's reference (model-ref), not a copy of the policy it resumes: KL is not reset
    _finish(_torchrun(run, "train.steps=5", *overrides, resume=True))
    resumed = _metrics(run)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5] and resumed[4]["kl"] > 0


CALLS = [0]


def _reinforce(batch, logprobs, advantages, nan_at_call: int):
    """A user loss (REINFORCE over response tokens) that returns NaN on its ``nan_at_call``-th call in this process."""
    CALLS[0] += 1
    mask = batch["loss_mask"]
    per_token = torch.where(mask, -advantages[:, None] * logprobs, torch.zeros((), device=logprobs.device))
    loss = per_token.sum() / mask.sum().clamp(min=1)
    return (loss * math.nan if CALLS[0] == nan_at_call else loss), {"tokens": float(mask.sum())}


def nan_on_the_third_step(batch, logprobs, *, advantages):
    """The user loss of the test below: NaN on the third step."""
    return _reinforce(batch, logprobs, advantages, nan_at_call=3)


def nan_on_the_fourth_step(batch, logprobs, *, advantages):
    """The user loss of test_recipe.py's guard test (whose step 3 the injected NaN rewards reject): NaN on step 4."""
    return _reinforce(batch, logprobs, advantages, nan_at_call=4)


# make test: test_recipe.py::test_guard_rejects_nan_batch_restores_exactly_and_dump_replays trains with
# nan_on_the_fourth_step in the same torchrun run (2 ranks) and checks the same: rejected, metrics logged, bit for bit
@pytest.mark.extended
def test_a_user_loss_passes_through_the_guard(tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    run = tmp_path / "run"
    _finish(_torchrun(run, "train.steps=4", "checkpoint.every=1", "checkpoint.keep=10", *SMALL,
                      "loss.fn=tests.integration.test_recipe_losses:nan_on_the_third_step", nproc=1))
    rows = {r["step"]: r for r in _metrics(run)}
    assert [rows[s]["accepted"] for s in (1, 2, 3, 4)] == [True, True, False, True]
    assert "non-finite" in rows[3]["guard_reason"] and rows[1]["loss/tokens"] > 0
    assert [rows[s]["policy_version"] for s in (1, 2, 3, 4)] == [1, 2, 2, 3]

    def state(step: int) -> dict:
        dcp_to_torch_save(str(run / "checkpoints" / f"step-{step:06d}"), str(tmp_path / f"s{step}.pt"))
        return torch.load(tmp_path / f"s{step}.pt", weights_only=False)

    before, after = state(2), state(3)
    for section in ("model", "optim"):
        flat_b, flat_a = _flatten(before[section]), _flatten(after[section])
        assert flat_b.keys() == flat_a.keys()
        for key, value in flat_b.items():
            same = torch.equal(value, flat_a[key]) if isinstance(value, torch.Tensor) else value == flat_a[key]
            assert same, f"{section}.{key} changed by the rejected update"
    assert sorted(p.name for p in (run / "dumps").glob("step-000003-rank*.msgpack"))  # the batch was dumped

"""The GRPO family of asyncrl.train.losses against hand computations on one fixed batch, and against TRL 1.16's own
``GRPOTrainer._compute_loss`` on the same numbers; user losses (``loss.fn``) and the old config names."""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from asyncrl.config import LossConfig, load_config
from asyncrl.train.advantages import compute_advantages, normalize_then_sum_advantages
from asyncrl.train.losses import compute_loss, policy_loss

# ---------------------------------------------------------------------------------------------------------------------
# the fixed batch: 2 groups of 2 rows, 3 positions, response lengths 3, 1, 2, 1
#
#   rewards  [1, 0 | 3, 1]     group means 0.5 and 2
#   mask     [[1 1 1], [1 0 0], [1 1 0], [1 0 0]]   -> 7 valid tokens

REWARDS = torch.tensor([1.0, 0.0, 3.0, 1.0])
GROUPS = torch.tensor([0, 0, 1, 1])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 0, 0]], dtype=torch.bool)
LP = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -9.0, -9.0], [-0.7, -1.2, -9.0], [-2.0, -9.0, -9.0]])


def close(actual, expected: float) -> None:
    assert float(torch.as_tensor(actual).detach()) == pytest.approx(expected, rel=1e-5, abs=1e-7)


def test_advantages_by_hand_for_each_scale_rewards():
    # none: r - group mean
    none = compute_advantages(REWARDS, GROUPS, scale_rewards="none")
    torch.testing.assert_close(none, torch.tensor([0.5, -0.5, 1.0, -1.0]))
    # group: / (unbiased group std + 1e-4); group 0: sqrt((0.25 + 0.25) / 1) = sqrt(0.5); group 1: sqrt(2)
    group = compute_advantages(REWARDS, GROUPS, scale_rewards="group")
    a0, a1 = 0.5 / (math.sqrt(0.5) + 1e-4), 1.0 / (math.sqrt(2) + 1e-4)
    torch.testing.assert_close(group, torch.tensor([a0, -a0, a1, -a1]))
    # batch: / (unbiased std of all four rewards + 1e-4): mean 1.25, squares .0625 + 1.5625 + 3.0625 + .0625 = 4.75
    batch = compute_advantages(REWARDS, GROUPS, scale_rewards="batch")
    std = math.sqrt(4.75 / 3)
    torch.testing.assert_close(batch, torch.tensor([0.5, -0.5, 1.0, -1.0]) / (std + 1e-4))
    # batch over two ranks: all_reduce sums (n, sum, sum of squares); the other rank holds 4 rewards [1, 1, 1, 1]
    other = torch.tensor([4.0, 4.0, 4.0])
    two = compute_advantages(REWARDS, GROUPS, scale_rewards="batch", all_reduce=lambda t: t + other)
    # all 8: sum 9, squares 11 + 4 = 15: var = (15 - 81/8) / 7
    torch.testing.assert_close(two, torch.tensor([0.5, -0.5, 1.0, -1.0]) / (math.sqrt((15 - 81 / 8) / 7) + 1e-4))


def test_advantages_of_singleton_constant_and_unscored_rows():
    rewards, groups = torch.tensor([5.0, 2.0, 2.0, 4.0, 0.0, 7.0]), torch.tensor([9, 3, 3, 1, 1, 1])
    scored = torch.tensor([True, True, True, True, False, True])
    adv = compute_advantages(rewards, groups, scale_rewards="group", scored=scored)
    # group 9 has one row (std undefined -> 0); group 3 is constant (0 / 1e-4 = 0); group 1 without its unscored
    # row: [4, 7] -> mean 5.5, std sqrt(4.5), and the unscored row gets 0
    s = math.sqrt(4.5) + 1e-4
    torch.testing.assert_close(adv, torch.tensor([0.0, 0.0, 0.0, -1.5 / s, 0.0, 1.5 / s]))
    none = compute_advantages(rewards, groups, scale_rewards="none", scored=scored)
    torch.testing.assert_close(none, torch.tensor([0.0, 0.0, 0.0, -1.5, 0.0, 1.5]))


# on-policy (old = logprobs): ratio 1 everywhere, so each valid token's policy loss is -A.
# with A = [0.5, -0.5, 1, -1] (scale_rewards none) and lengths 3, 1, 2, 1:
#   token sum = -(0.5*3 - 0.5*1 + 1*2 - 1*1) = -2
#   grpo:    mean of row means = -(0.5 - 0.5 + 1 - 1) / 4 = 0
#   bnpo:    -2 / 7
#   dr_grpo: -2 / (4 rows * max_completion_length 4) = -0.125
#   dapo:    -2 / 7 on one rank; with another rank of 5 tokens: -2 / ((7 + 5) / 2)
ADV_NONE = torch.tensor([0.5, -0.5, 1.0, -1.0])
EXPECTED = {"grpo": 0.0, "bnpo": -2 / 7, "dr_grpo": -0.125, "dapo": -2 / 7}


def _loss(config: LossConfig, adv=ADV_NONE, **kw):
    lp = LP.clone().requires_grad_(True)
    loss, metrics = policy_loss(lp, lp.detach(), LP, adv, MASK, config=config, **kw)
    loss.backward()
    return loss, metrics, lp.grad


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_each_loss_type_by_hand(loss_type):
    config = LossConfig(loss_type=loss_type, correction="none", max_completion_length=4)
    loss, _, grad = _loss(config)
    close(loss, EXPECTED[loss_type])
    # d loss / d logp at a token = -A * (its weight): grpo 1 / (4 * row length), bnpo and dapo 1/7, dr_grpo 1/16
    weight = {"grpo": 1 / (4 * MASK.sum(-1, keepdim=True).float()), "bnpo": 1 / 7, "dapo": 1 / 7, "dr_grpo": 1 / 16}
    expected = torch.where(MASK, -ADV_NONE[:, None] * weight[loss_type], torch.zeros(()))
    torch.testing.assert_close(grad, expected.expand_as(grad))


def test_other_surrogates_and_gspo_by_hand():
    """On-policy (ratio 1): cispo's token term is -A * logp (weight min(1, cap) = 1), aggregated as dapo; sapo's gate
    is sigmoid(0) * 4 / tau = 2 / tau with slope 1 at r = 1, aggregated as grpo; GSPO (one ratio per sequence)
    equals the token level at ratio 1 under grpo; luspo sums each row's tokens, then means over rows."""
    loss, _, grad = _loss(LossConfig(loss_type="cispo", epsilon_high=5.0, correction="none"))
    per_token = torch.where(MASK, -ADV_NONE[:, None] * LP, torch.zeros(()))
    close(loss, float(per_token.sum() / 7))
    torch.testing.assert_close(grad, torch.where(MASK, -ADV_NONE[:, None] / 7, torch.zeros(())))
    loss, _, grad = _loss(LossConfig(loss_type="sapo", correction="none"))
    tau = torch.where(ADV_NONE > 0, 1.0, 1.05)
    close(loss, float((-2 / tau * ADV_NONE).mean()))
    row_weight = 1 / (4 * MASK.sum(-1, keepdim=True).float())
    torch.testing.assert_close(grad, torch.where(MASK, -ADV_NONE[:, None] * row_weight, torch.zeros(())))
    token_loss, _, token_grad = _loss(LossConfig(loss_type="grpo", correction="none"))
    seq_loss, _, seq_grad = _loss(LossConfig(loss_type="grpo", importance_sampling_level="sequence", correction="none"))
    close(seq_loss, float(token_loss.detach()))
    torch.testing.assert_close(seq_grad, token_grad)
    loss, _, grad = _loss(LossConfig(loss_type="luspo", importance_sampling_level="sequence", correction="none"))
    close(loss, float((-ADV_NONE * MASK.sum(-1)).mean()))
    torch.testing.assert_close(grad, torch.where(MASK, -ADV_NONE[:, None] / 4, torch.zeros(())))


def _vespo_phi(w: float, k: float, lam: float) -> float:
    return math.exp(lam) * w ** k * math.exp(-lam * w)  # phi(w) = e^lambda w^k e^(-lambda w), phi(1) = 1


def test_vespo_by_hand():
    """VESPO: -phi(w) * A * logp with the sequence ratio w = exp(sum of the row's log-ratios), phi detached, k and
    lambda by the advantage's sign (A >= 0: 2, 3; A < 0: 3, 2), aggregated as dapo (sum / 7 tokens on one rank)."""
    old = LP.clone()
    old[0, 0], old[1, 0], old[2, 1] = LP[0, 0] - math.log(1.5), LP[1, 0] - math.log(1.6), LP[2, 1] - math.log(0.7)
    phi = [_vespo_phi(1.5, 2, 3), _vespo_phi(1.6, 3, 2), _vespo_phi(0.7, 2, 3), 1.0]  # row 3 on-policy: phi(1) = 1
    lp = LP.clone().requires_grad_(True)
    config = LossConfig(loss_type="vespo", correction="none")
    loss, m = policy_loss(lp, old, old, ADV_NONE, MASK, config=config)
    per_token = torch.where(MASK, -torch.tensor(phi)[:, None] * ADV_NONE[:, None] * LP, torch.zeros(()))
    # row 0: phi0 * 0.5 * 3.5, row 1: -phi1 * 0.5 * 1.5, row 2: phi2 * 1.9, row 3: -2
    close(loss, (phi[0] * 1.75 - phi[1] * 0.75 + phi[2] * 1.9 - 2) / 7)
    close(loss, float(per_token.sum() / 7))
    close(m["vespo/phi_seq_mean"], sum(phi) / 4)
    loss.backward()  # the weight is a constant: d loss / d logp = -phi * A / 7
    torch.testing.assert_close(lp.grad, torch.where(MASK, -torch.tensor(phi)[:, None] * ADV_NONE[:, None] / 7,
                                                     torch.zeros(())))
    # the correction's weight enters w instead of each token: row 3 sampled at rho = 1.5 (A = -1: phi(1.5; 3, 2)),
    # row 0's second token at rho = 3, truncated to is_cap 2: w = 1.5 * 2
    rollout = old.clone()
    rollout[3, 0], rollout[0, 1] = old[3, 0] - math.log(1.5), old[0, 1] - math.log(3.0)
    _, m = policy_loss(lp, old, rollout, ADV_NONE, MASK, config=LossConfig(loss_type="vespo", correction="tis"))
    close(m["vespo/phi_seq_mean"], (_vespo_phi(3.0, 2, 3) + phi[1] + phi[2] + _vespo_phi(1.5, 3, 2)) / 4)
    far = LP.clone()
    far[0] -= 30.0  # row 0's log w clamped at 20: phi = e^(3 + 40 - 3 e^20) underflows to 0; the others on-policy
    loss, m = policy_loss(lp, far, far, ADV_NONE, MASK, config=config)
    assert loss.isfinite() and m["vespo/phi_seq_mean"] == pytest.approx((0 + 1 + 1 + 1) / 4)
    with pytest.raises(ValueError, match="importance_sampling_level"):
        LossConfig(loss_type="vespo", importance_sampling_level="sequence")
    with pytest.raises(ValueError, match="tis_seq"):
        LossConfig(loss_type="vespo", correction="tis_seq")
    with pytest.raises(ValueError, match="vespo_k_pos"):
        LossConfig(loss_type="vespo", vespo_lambda_neg=-1.0)


def test_delta_caps_the_unclipped_ratio_of_negative_advantages():
    lp = LP.clone().requires_grad_(True)
    old = LP.clone()
    old[1, 0] = LP[1, 0] - math.log(2.0)  # ratio 2 on a token of advantage -0.5: PPO's max takes the unclipped 2
    plain, _ = policy_loss(lp, old, old, ADV_NONE, MASK, config=LossConfig(loss_type="bnpo", correction="none"))
    capped, _ = policy_loss(lp, old, old, ADV_NONE, MASK,
                            config=LossConfig(loss_type="bnpo", correction="none", delta=1.5))
    close(float(plain) - float(capped), 0.5 * (2.0 - 1.5) / 7)
    with pytest.raises(ValueError, match="delta"):
        LossConfig(delta=1.0)
    with pytest.raises(ValueError, match="importance_sampling_level"):
        LossConfig(importance_sampling_level="group")


def test_dapo_normalises_by_the_tokens_of_all_ranks():
    config = LossConfig(loss_type="dapo", correction="none")
    loss, _, _ = _loss(config, all_reduce=lambda t: t + torch.tensor([5.0, 1.0]))  # the other rank: 5 tokens
    close(loss, -2 / ((7 + 5) / 2))


def test_dr_grpo_needs_its_constant():
    with pytest.raises(ValueError, match="max_completion_length"):
        _loss(LossConfig(loss_type="dr_grpo"))


def test_epsilon_and_epsilon_high_clip_by_hand():
    # row 0 (A = +0.5) token 0 at ratio 1.5, row 1 (A = -0.5) token 0 at ratio 0.5, the rest at ratio 1
    old = LP.clone()
    old[0, 0], old[1, 0] = LP[0, 0] - math.log(1.5), LP[1, 0] - math.log(0.5)
    lp = LP.clone().requires_grad_(True)
    config = LossConfig(loss_type="bnpo", correction="none", epsilon=0.1, epsilon_high=0.28)
    loss, m = policy_loss(lp, old, old, ADV_NONE, MASK, config=config)
    # row 0 token 0: -min(1.5 * 0.5, 1.28 * 0.5) = -0.64; row 1 token 0: -min(0.5 * -0.5, 0.9 * -0.5) = 0.45
    tokens = [-0.64, -0.5, -0.5, 0.45, -1.0, -1.0, 1.0]
    close(loss, sum(tokens) / 7)
    close(m["clip_ratio/high_mean"], 1 / 7)  # ratio > 1 + epsilon_high with A > 0
    close(m["clip_ratio/low_mean"], 1 / 7)  # ratio < 1 - epsilon with A < 0
    close(m["clip_ratio/region_mean"], 2 / 7)


def test_beta_adds_k3_per_token_before_aggregation():
    # ref - logp = ln 2 at row 0 token 0: k3 = e^(ln 2) - ln 2 - 1 = 1 - ln 2; 0 elsewhere
    ref = LP.clone()
    ref[0, 0] += math.log(2)
    k3 = 1 - math.log(2)
    for loss_type, expected in [("grpo", 0.0 + 0.04 * k3 / 3 / 4), ("bnpo", -2 / 7 + 0.04 * k3 / 7)]:
        loss, m, _ = _loss(LossConfig(loss_type=loss_type, correction="none", beta=0.04), ref_logprobs=ref)
        close(loss, expected)
        close(m["kl"], k3 / 7)  # logged as the token mean (TRL's kl metric)
        close(m["pg_loss"], EXPECTED[loss_type])


def test_mask_truncated_completions_drops_rows_that_hit_the_limit():
    # row 3 (A = -1, 1 token) truncated: token sum -(1.5 - 0.5 + 2) = -3 over 6 tokens
    config = LossConfig(loss_type="bnpo", correction="none", mask_truncated_completions=True)
    loss, m, grad = _loss(config, truncated=torch.tensor([False, False, False, True]))
    close(loss, -3 / 6)
    close(m["truncated_masked_fraction"], 1 / 7)
    assert grad[3].eq(0).all()
    with pytest.raises(ValueError, match="needs truncated"):
        _loss(config)


def _batch(finish=("stop", "stop", "stop", "length")) -> dict:
    return {"rewards": REWARDS, "group_index": GROUPS, "loss_mask": MASK, "rollout_logprobs": LP.clone(),
            "token_versions": torch.zeros(4, 3, dtype=torch.long), "finish_reasons": list(finish),
            "reward_components": {}}


def test_compute_loss_is_advantages_then_the_loss():
    config = LossConfig(loss_type="bnpo", scale_rewards="none", correction="none", mask_truncated_completions=True)
    loss, _, adv = compute_loss(_batch(), LP.clone().requires_grad_(True), config=config)
    torch.testing.assert_close(adv, ADV_NONE)
    close(loss, -3 / 6)  # the truncated row 3 is out
    unscored = _batch()
    unscored["reward_components"] = {"unscored": torch.tensor([math.nan, math.nan, math.nan, 1.0])}
    _, _, adv = compute_loss(unscored, LP.clone().requires_grad_(True), config=config)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, 0.0, 0.0]))  # group 1's mean is row 2's reward alone


# ---------------------------------------------------------------------------------------------------------------------
# against TRL's own code


def _trl_loss(loss_type: str, lp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, ref: torch.Tensor | None,
              beta: float, level: str = "token", delta: float | None = None, epsilon_high: float = 0.2,
              importance_sampling_ratio: torch.Tensor | None = None):
    """TRL 1.16's ``GRPOTrainer._compute_loss`` on our numbers: a stand-in ``self`` whose forward returns ``lp``
    (``importance_sampling_ratio``: vLLM's token-level ratio, which only ``vespo`` reads with ``use_vllm`` off)."""
    grpo_trainer = pytest.importorskip("trl.trainer.grpo_trainer")
    accelerator = SimpleNamespace(num_processes=1, gather=lambda t: t, gather_for_metrics=lambda t: t,
                                  reduce=lambda t, reduction: t, sync_gradients=True)
    fake = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (lp, torch.zeros_like(lp), None),
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level=level, beta=beta,
        loss_type=loss_type, epsilon_low=0.2, epsilon_high=epsilon_high, use_vllm=False,
        model=SimpleNamespace(training=True), get_gamma_weights=grpo_trainer.GRPOTrainer.get_gamma_weights,
        current_gradient_accumulation_steps=1, max_completion_length=4, accelerator=accelerator,
        _entropy_bonus_enabled=False, aux_loss_enabled=False, _metrics={"train": defaultdict(list)},
        args=SimpleNamespace(delta=delta, use_bias_correction_kl=False, steps_per_generation=1,
                             sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, vespo_k_pos=2.0,
                             vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0),
    )
    inputs = {"prompt_ids": torch.zeros(4, 0, dtype=torch.long), "prompt_mask": torch.zeros(4, 0, dtype=torch.long),
              "completion_ids": torch.zeros(4, 3, dtype=torch.long), "completion_mask": MASK.long(),
              "advantages": adv, "num_items_in_batch": MASK.sum(), "old_per_token_logps": old}
    if ref is not None:
        inputs["ref_per_token_logps"] = ref
    if importance_sampling_ratio is not None:
        inputs["importance_sampling_ratio"] = importance_sampling_ratio
    return grpo_trainer.GRPOTrainer._compute_loss(fake, None, inputs), fake._metrics["train"]


@pytest.mark.slow  # importing trl's trainer takes ~20 s (it imports vLLM)
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_each_loss_type_matches_trl(loss_type):
    old = LP.clone()
    old[0, 0], old[2, 1] = LP[0, 0] - math.log(1.5), LP[2, 1] - math.log(0.7)  # two tokens off-policy, one clipped
    ref = LP + 0.3 * torch.tensor([[1.0, -1.0, 0.5], [2.0, 0.0, 0.0], [-0.5, 1.0, 0.0], [0.2, 0.0, 0.0]])
    adv = compute_advantages(REWARDS, GROUPS, scale_rewards="group")
    lp_trl = LP.clone().requires_grad_(True)
    expected, trl_metrics = _trl_loss(loss_type, lp_trl, old, adv, ref, beta=0.05)
    lp = LP.clone().requires_grad_(True)
    config = LossConfig(loss_type=loss_type, correction="none", beta=0.05, max_completion_length=4)
    ours, metrics = policy_loss(lp, old, old, adv, MASK, config=config, ref_logprobs=ref)
    close(ours, float(expected.detach()))
    expected.backward()
    ours.backward()
    torch.testing.assert_close(lp.grad, lp_trl.grad)
    assert metrics["kl"] == pytest.approx(trl_metrics["kl"][0], rel=1e-5)
    assert metrics["clip_ratio/region_mean"] == pytest.approx(trl_metrics["clip_ratio/region_mean"][0], rel=1e-5)


@pytest.mark.slow  # importing trl's trainer takes ~20 s (it imports vLLM)
@pytest.mark.parametrize(("loss_type", "level", "delta", "epsilon_high"), [
    ("cispo", "token", None, 5.0), ("sapo", "token", None, 0.2), ("luspo", "sequence", None, 0.2),
    ("vespo", "token", None, 0.2),
    ("grpo", "sequence", None, 0.2), ("dapo", "token", 1.3, 0.2), ("bnpo", "sequence", 1.3, 0.2)])
def test_other_surrogates_gspo_and_delta_match_trl(loss_type, level, delta, epsilon_high):
    """Off-policy tokens (ratios 1.5 and 0.7) so that clipping, the delta cap and the gates all bite."""
    old = LP.clone()
    old[0, 0], old[2, 1], old[1, 0] = LP[0, 0] - math.log(1.5), LP[2, 1] - math.log(0.7), LP[1, 0] - math.log(1.6)
    ref = LP + 0.3 * torch.tensor([[1.0, -1.0, 0.5], [2.0, 0.0, 0.0], [-0.5, 1.0, 0.0], [0.2, 0.0, 0.0]])
    adv = compute_advantages(REWARDS, GROUPS, scale_rewards="group")
    lp_trl = LP.clone().requires_grad_(True)
    expected, _ = _trl_loss(loss_type, lp_trl, old, adv, ref, beta=0.05, level=level, delta=delta,
                            epsilon_high=epsilon_high)
    lp = LP.clone().requires_grad_(True)
    config = LossConfig(loss_type=loss_type, correction="none", beta=0.05, importance_sampling_level=level,
                        delta=delta, epsilon_high=epsilon_high)
    ours, _ = policy_loss(lp, old, old, adv, MASK, config=config, ref_logprobs=ref)
    close(ours, float(expected.detach()))
    expected.backward()
    ours.backward()
    torch.testing.assert_close(lp.grad, lp_trl.grad)


# ---------------------------------------------------------------------------------------------------------------------
# user losses and old names


def reinforce(batch, logprobs, *, advantages):
    """A user loss: -A * logp over the response tokens, with one extra metric."""
    mask = batch["loss_mask"]
    per_token = torch.where(mask, -advantages[:, None] * logprobs, torch.zeros(()))
    return per_token.sum() / mask.sum(), {"tokens": float(mask.sum())}


def nan_loss(batch, logprobs, **kwargs):
    return (logprobs * float("nan")).sum()


def not_a_scalar(batch, logprobs, **kwargs):
    return logprobs


def test_a_user_loss_gets_the_batch_logprobs_and_advantages():
    config = LossConfig(fn="tests.unit.train.test_loss_variants:reinforce", scale_rewards="none")
    lp = LP.clone().requires_grad_(True)
    loss, metrics, _ = compute_loss(_batch(), lp, config=config)
    close(loss, float(torch.where(MASK, -ADV_NONE[:, None] * LP, torch.zeros(())).sum() / 7))
    assert metrics["tokens"] == 7 and metrics["loss"] == pytest.approx(float(loss))
    with pytest.raises(TypeError, match="must return a scalar tensor"):
        compute_loss(_batch(), lp, config=LossConfig(fn="tests.unit.train.test_loss_variants:not_a_scalar"))
    with pytest.raises(ValueError, match="module:function"):
        LossConfig(fn="reinforce")


@pytest.mark.parametrize("old, new", [("clip_low", "loss.epsilon"), ("clip_high", "loss.epsilon_high"),
                                      ("kl_coef", "loss.beta"), ("aggregation", "loss.loss_type")])
def test_old_names_fail_with_the_new_name(old, new):
    """The names before TRL's are refused, the message naming the key to use (asyncrl.config.renames)."""
    with pytest.raises(ValueError, match=rf"loss\.{old} was renamed .*: use {new}"):
        load_config(None, [f"loss.{old}=0.1"])
    assert LossConfig(epsilon=0.3).epsilon_high == 0.3 and LossConfig(scale_rewards=False).scale_rewards == "none"
    with pytest.raises(ValueError, match="loss.loss_type"):
        LossConfig(loss_type="batch")


def test_a_nan_reward_is_not_hidden_from_the_guard():
    adv = compute_advantages(torch.tensor([1.0, math.nan, 2.0, 0.0]), GROUPS, scale_rewards="group")
    assert adv[:2].isnan().all() and adv[2:].isfinite().all()


# ---------------------------------------------------------------------------------------------------------------------
# multi_objective_aggregation: normalize_then_sum


def _trl_normalize_then_sum(per_func: torch.Tensor, weights: torch.Tensor, n: int) -> torch.Tensor:
    """TRL 1.16's lines (``GRPOTrainer._generate_and_score_completions``, ``normalize_then_sum``), on ``[B, K]``
    rewards with NaN where a function did not score and groups of ``n`` consecutive rows."""
    def nanstd(t, dim=None, keepdim=False):  # trl.trainer.utils.nanstd
        mean = torch.nanmean(t, dim=dim, keepdim=True)
        var = torch.nanmean((t - mean) ** 2, dim=dim, keepdim=True)
        count = torch.sum(~torch.isnan(t), dim=dim, keepdim=True)
        var = var * torch.where(count > 1, count / (count - 1), torch.full_like(count.float(), float("nan")))
        std = var.sqrt()
        return std if keepdim else (std.squeeze() if dim is None else std.squeeze(dim))

    unscorable = torch.isnan(per_func).all(dim=1)
    grouped = per_func.view(-1, n, per_func.shape[1])
    mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
    std_k = nanstd(grouped, dim=1, keepdim=True)
    reward_k = ((grouped - mean_k) / (std_k + 1e-4)).view(-1, per_func.shape[1])
    rewards = (reward_k * weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable] = torch.nan
    std = nanstd(rewards).expand_as(rewards)
    return torch.nan_to_num((rewards - torch.nanmean(rewards)) / (std + 1e-4), nan=0.0)


def test_normalize_then_sum_matches_trls_formula():
    nan = float("nan")
    # 3 groups of 3; two functions on very different scales; function b skips some rows; row 8 is unscored
    a = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, nan])
    b = torch.tensor([40.0, 90.0, nan, 10.0, 12.0, 11.0, nan, 100.0, nan])
    weights = {"a": 1.0, "b": 0.5}
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2])
    ours = normalize_then_sum_advantages({"a": a, "b": b, "env_info": torch.ones(9)}, weights, groups)
    expected = _trl_normalize_then_sum(torch.stack([a, b], 1), torch.tensor([1.0, 0.5]), 3)
    torch.testing.assert_close(ours, expected)
    assert ours[8] == 0  # nothing scored it
    # across ranks: the batch mean/std count the other rank's rows; here the other rank is this batch again
    twice = normalize_then_sum_advantages({"a": a, "b": b}, weights, groups, all_reduce=lambda t: t * 2)
    expected2 = _trl_normalize_then_sum(torch.stack([a, b], 1).repeat(2, 1), torch.tensor([1.0, 0.5]), 3)[:9]
    torch.testing.assert_close(twice, expected2)


def test_normalize_then_sum_through_compute_loss():
    batch = {"rewards": torch.tensor([1.0, 0.0, 3.0, 1.0]), "group_index": GROUPS, "loss_mask": MASK,
             "rollout_logprobs": LP, "token_versions": torch.zeros_like(LP, dtype=torch.long),
             "reward_components": {"a": torch.tensor([1.0, 0.0, 1.0, 0.0]), "b": torch.tensor([0.0, 0.0, 2.0, 1.0])},
             "finish_reasons": ["stop"] * 4}
    config = LossConfig(multi_objective_aggregation="normalize_then_sum", correction="none")
    _, _, adv = compute_loss(batch, LP.clone().requires_grad_(True), config=config, reward_weights={"a": 1, "b": 1})
    torch.testing.assert_close(adv, normalize_then_sum_advantages(batch["reward_components"], {"a": 1, "b": 1}, GROUPS))
    with pytest.raises(ValueError, match="reward_weights"):
        compute_loss(batch, LP.clone().requires_grad_(True), config=config)
    with pytest.raises(ValueError, match="batch components"):
        compute_loss(batch, LP.clone().requires_grad_(True), config=config, reward_weights={"math": 1.0})
    nan_batch = {**batch, "rewards": torch.full((4,), float("nan"))}  # the guard's injected NaN stays visible
    _, _, adv = compute_loss(nan_batch, LP.clone().requires_grad_(True), config=config, reward_weights={"a": 1, "b": 1})
    assert adv.isnan().all()


@pytest.mark.slow  # importing trl's trainer takes ~20 s (it imports vLLM)
def test_vespo_with_a_truncated_correction_matches_trl():
    """``correction: tis`` under vespo is TRL's ``vllm_importance_sampling_mode: token_truncate``: the truncated
    token ratios ``min(exp(old - rollout), is_cap)`` enter the sequence weight (TRL's ``importance_sampling_ratio``,
    1 at padding); the loss, its gradient and ``vespo/phi_seq_mean`` agree."""
    old = LP.clone()
    old[0, 0], old[2, 1], old[1, 0] = LP[0, 0] - math.log(1.5), LP[2, 1] - math.log(0.7), LP[1, 0] - math.log(1.6)
    rollout = old.clone()
    rollout[0, 1], rollout[3, 0], rollout[2, 0] = old[0, 1] - math.log(3.0), old[3, 0] - math.log(1.3), old[2, 0] + 0.4
    ratio = torch.where(MASK, (old - rollout).exp().clamp(max=2.0), torch.ones(()))
    ref = LP + 0.3 * torch.tensor([[1.0, -1.0, 0.5], [2.0, 0.0, 0.0], [-0.5, 1.0, 0.0], [0.2, 0.0, 0.0]])
    adv = compute_advantages(REWARDS, GROUPS, scale_rewards="group")
    lp_trl = LP.clone().requires_grad_(True)
    expected, trl_metrics = _trl_loss("vespo", lp_trl, old, adv, ref, beta=0.05, importance_sampling_ratio=ratio)
    lp = LP.clone().requires_grad_(True)
    config = LossConfig(loss_type="vespo", correction="tis", is_cap=2.0, beta=0.05)
    ours, metrics = policy_loss(lp, old, rollout, adv, MASK, config=config, ref_logprobs=ref)
    close(ours, float(expected.detach()))
    expected.backward()
    ours.backward()
    torch.testing.assert_close(lp.grad, lp_trl.grad)
    assert metrics["vespo/phi_seq_mean"] == pytest.approx(trl_metrics["vespo/phi_seq_mean"][0], rel=1e-5)


def test_every_loss_type_is_one_registry_entry():
    """``loss.loss_type`` picks a surrogate and an aggregation from one registry (asyncrl.train.surrogates): the
    config's names, its Literal and the registry are the same set, and every aggregation exists."""
    import typing

    from asyncrl.config.train import LOSS_TYPES as NAMES
    from asyncrl.train.surrogates import AGGREGATIONS, LOSS_TYPES

    assert set(LOSS_TYPES) == set(NAMES) == set(typing.get_args(typing.get_type_hints(LossConfig)["loss_type"]))
    assert all(t.aggregation in AGGREGATIONS for t in LOSS_TYPES.values())

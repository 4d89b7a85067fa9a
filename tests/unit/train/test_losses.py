"""Tests for asyncrl.train.losses: hand-computed values on 2 x 4 batches for every advantage, loss and metric path."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.config import LossConfig
from asyncrl.train.advantages import group_advantages
from asyncrl.train.corrections import mismatch_metrics
from asyncrl.train.losses import policy_loss

LOG = math.log
ALL = torch.ones(2, 4, dtype=torch.bool)

# ----------------------------------------------------------------------------------------------------------------------
# helpers


def t(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def run(
    lp: torch.Tensor,
    old: torch.Tensor,
    rollout: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor = ALL,
    **kwargs,
) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
    """policy_loss on a leaf copy of ``lp``; returns (loss, metrics, d loss / d lp)."""
    config = kwargs.pop("config", None) or LossConfig(**kwargs.pop("cfg", {}))
    lp = lp.clone().requires_grad_(True)
    loss, metrics = policy_loss(lp, old, rollout, adv, mask, config=config, **kwargs)
    loss.backward()
    return loss, metrics, lp.grad


def close(actual: torch.Tensor | float, expected: float) -> None:
    assert float(torch.as_tensor(actual).detach()) == pytest.approx(expected, rel=1e-5, abs=1e-6)


# ----------------------------------------------------------------------------------------------------------------------
# group_advantages


def test_group_advantages_with_std():
    # group 0: mean 0.5, std 0.5; group 1: mean 2, std 1
    adv = group_advantages(torch.tensor([1.0, 0.0, 3.0, 1.0]), torch.tensor([0, 0, 1, 1]), eps=1e-6)
    torch.testing.assert_close(adv, torch.tensor([0.5 / 0.500001, -0.5 / 0.500001, 1 / 1.000001, -1 / 1.000001]))


def test_group_advantages_without_std():
    adv = group_advantages(torch.tensor([1.0, 0.0, 3.0, 1.0]), torch.tensor([0, 0, 1, 1]), normalize_std=False)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, 1.0, -1.0]))


def test_group_advantages_constant_singleton_and_arbitrary_ids():
    # group 7 is constant -> 0 (not NaN); group 3 is a singleton -> 0; ids need not be 0..G-1 nor sorted
    rewards = torch.tensor([2.0, 2.0, 5.0, 0.0, 4.0])
    adv = group_advantages(rewards, torch.tensor([7, 7, 3, 9, 9]))
    torch.testing.assert_close(adv, torch.tensor([0.0, 0.0, 0.0, -2 / (2 + 1e-6), 2 / (2 + 1e-6)]))
    ints = group_advantages(torch.tensor([1, 0]), torch.tensor([0, 0]), normalize_std=False)
    assert ints.dtype == torch.float32 and ints.tolist() == [0.5, -0.5]


def test_group_advantages_errors():
    with pytest.raises(ValueError, match="rewards.shape"):
        group_advantages(torch.zeros(3), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="eps=0"):
        group_advantages(torch.zeros(2), torch.zeros(2, dtype=torch.long), eps=0)


# ----------------------------------------------------------------------------------------------------------------------
# LossConfig


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"epsilon": 1.0}, "epsilon"),
        ({"epsilon_high": -0.1}, "epsilon_high"),
        ({"beta": -1.0}, "beta"),
        ({"loss_type": "batch"}, "loss_type"),
        ({"correction": "is"}, "correction"),
        ({"is_cap": 0.0}, "is_cap"),
        ({"mis_low": 1.5}, "mis_low"),
        ({"mis_high": 0.9}, "mis_high"),
        ({"max_version_gap": -1}, "max_version_gap"),
    ],
)
def test_loss_config_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LossConfig(**kwargs)


# ----------------------------------------------------------------------------------------------------------------------
# PPO clip

OLD = t([[-1.0, -2.0, -0.5, -1.5], [-1.0, -2.0, -0.5, -1.5]])
RATIOS = [[1.5, 0.9, 1.0, 0.5], [1.5, 0.5, 0.9, 1.1]]
LP = OLD + t(RATIOS).log()
ADV = torch.tensor([1.0, -1.0])


def test_ppo_clip_by_hand():
    loss, m, grad = run(LP, OLD, OLD, ADV, cfg={"correction": "none"})
    # A=+1: -min(r, clip(r)) -> 1.5 clipped to 1.2; 0.5 is not clipped from below (min keeps 0.5)
    row0 = [-1.2, -0.9, -1.0, -0.5]
    # A=-1: max(r, clip(r)) -> 0.5 clipped up to 0.8; 1.5 is not clipped from above (max keeps 1.5)
    row1 = [1.5, 0.8, 0.9, 1.1]
    close(loss, (sum(row0) + sum(row1)) / 8)  # 0.0875
    close(m["loss"], 0.0875)
    close(m["pg_loss"], 0.0875)
    close(m["clip_fraction"], 2 / 8)
    close(m["ratio_mean"], 7.9 / 8)
    close(m["is_weight_mean"], 1.0)
    assert m["valid_tokens"] == 8 and "kl" not in m
    # d/dlp of -r*A is -r*A; clipped tokens get no gradient
    torch.testing.assert_close(grad, t([[0.0, -0.9, -1.0, -0.5], [1.5, 0.0, 0.9, 1.1]]) / 8)


def test_ppo_asymmetric_clip():
    loss, m, _ = run(LP, OLD, OLD, ADV, cfg={"correction": "none", "epsilon": 0.1, "epsilon_high": 0.28})
    row0 = [-1.28, -0.9, -1.0, -0.5]  # 1.5 -> 1.28
    row1 = [1.5, 0.9, 0.9, 1.1]  # 0.5 -> 0.9
    close(loss, (sum(row0) + sum(row1)) / 8)
    close(m["clip_fraction"], 2 / 8)


def test_advantages_per_token_accepted():
    adv = ADV[:, None].expand(2, 4).clone()
    loss_b, _, _ = run(LP, OLD, OLD, ADV, cfg={"correction": "none"})
    loss_bl, _, _ = run(LP, OLD, OLD, adv, cfg={"correction": "none"})
    close(loss_bl, loss_b.item())


# ----------------------------------------------------------------------------------------------------------------------
# corrections (lp == old, so the PPO ratio is 1 and each token's term is -A * w)

ZERO = torch.zeros(2, 4)


def test_tis_truncates_per_token():
    rollout = -t([[LOG(3), LOG(0.5), 0.0, LOG(1.5)], [0.0, 0.0, 0.0, LOG(4)]])  # old - rollout = log rho
    loss, m, grad = run(ZERO, ZERO, rollout, torch.tensor([1.0, 2.0]), cfg={"correction": "tis", "is_cap": 2.0})
    w = [[2.0, 0.5, 1.0, 1.5], [1.0, 1.0, 1.0, 2.0]]  # 3 -> 2, 4 -> 2
    close(loss, -(1 * sum(w[0]) + 2 * sum(w[1])) / 8)  # -1.875
    close(m["is_weight_mean"], 10 / 8)
    torch.testing.assert_close(grad, -t(w) * torch.tensor([[1.0], [2.0]]) / 8)  # weights are constants


def test_tis_seq_uses_sequence_sum_of_masked_tokens():
    mask = torch.tensor([[True] * 4, [True, True, True, False]])
    # row 0: prod rho = 3 -> capped at 2; row 1: 1.5 * 1.2 * 0.5 = 0.9 (the masked 100 is not in the product)
    rollout = -t([[LOG(3), 0.0, 0.0, 0.0], [LOG(1.5), LOG(1.2), LOG(0.5), LOG(100)]])
    loss, m, _ = run(ZERO, ZERO, rollout, torch.tensor([1.0, 1.0]), mask, cfg={"correction": "tis_seq"})
    close(loss, -(4 * 2.0 + 3 * 0.9) / 7)
    close(m["is_weight_mean"], (4 * 2.0 + 3 * 0.9) / 7)


def test_mis_masks_exactly_out_of_range_tokens():
    rho = [[0.4, 0.51, 1.99, 2.1], [1.0, 0.49, 1.9, 3.0]]  # kept: (0,1) (0,2) (1,0) (1,2)
    adv = t([[1, 2, 4, 8], [16, 32, 64, 128]])
    loss, m, grad = run(ZERO, ZERO, -t(rho).log(), adv, cfg={"correction": "mis"})
    close(loss, -(2 + 4 + 16 + 64) / 4)
    close(m["correction_masked_fraction"], 4 / 8)
    close(m["is_weight_mean"], 1.0)
    assert m["valid_tokens"] == 4
    kept = t([[0, 1, 1, 0], [1, 0, 1, 0]])
    torch.testing.assert_close(grad, -adv * kept / 4)


def test_decoupled_weights_by_behaviour_and_masks_above_cap():
    old = ZERO
    lp = t([[LOG(1.5), LOG(0.9), 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])  # proximal ratio r
    rollout = -t([[LOG(1.5), LOG(3.0), 0.0, 0.0], [LOG(0.5), 0.0, 0.0, 0.0]])  # behaviour weight rho
    loss, m, _ = run(lp, old, rollout, torch.tensor([1.0, 1.0]), cfg={"correction": "decoupled", "is_cap": 2.0})
    # row 0: clip(1.5)=1.2 times rho 1.5; rho 3 > cap 2: masked out (AReaL); row 1: 1 times rho 0.5
    row0 = [-1.2 * 1.5, -1.0, -1.0]
    row1 = [-0.5, -1.0, -1.0, -1.0]
    close(loss, (sum(row0) + sum(row1)) / 7)
    close(m["is_weight_mean"], (1.5 + 1 + 1 + 0.5 + 1 + 1 + 1) / 7)
    close(m["correction_masked_fraction"], 1 / 8)
    # tis truncates the same token instead of dropping it, so the two differ here
    tis, _, _ = run(lp, old, rollout, torch.tensor([1.0, 1.0]), cfg={"correction": "tis", "is_cap": 2.0})
    close(tis, (-1.2 * 1.5 - 0.9 * 2.0 - 1.0 - 1.0 + sum(row1)) / 8)


# ----------------------------------------------------------------------------------------------------------------------
# version gap, KL, aggregation


def test_version_gap_masks_stale_tokens():
    mask = torch.tensor([[True] * 4, [True, True, True, False]])
    versions = torch.tensor([[5, 4, 3, 2], [5, 5, 1, -1]])
    adv = t([[1, 2, 4, 8], [16, 32, 64, 128]])
    cfg = {"correction": "none", "max_version_gap": 2}
    loss, m, _ = run(ZERO, ZERO, ZERO, adv, mask, cfg=cfg, token_versions=versions, trainer_version=5)
    close(loss, -(1 + 2 + 4 + 16 + 32) / 5)
    close(m["version_masked_fraction"], 2 / 7)
    with pytest.raises(ValueError, match="max_version_gap=2 needs token_versions"):
        run(ZERO, ZERO, ZERO, adv, mask, cfg=cfg)


def test_k3_kl_term():
    delta = t([[0.0, LOG(2), -LOG(2), 1.0], [0.0, 0.0, 0.0, 0.0]])  # ref - lp
    k3 = [0.0, 2 - LOG(2) - 1, 0.5 + LOG(2) - 1, math.e - 2]
    cfg = {"correction": "none", "beta": 0.1}
    loss, m, grad = run(ZERO, ZERO, ZERO, torch.zeros(2), ref_logprobs=delta, cfg=cfg)  # A = 0: only KL
    close(m["kl"], sum(k3) / 8)
    close(loss, 0.1 * sum(k3) / 8)
    close(m["pg_loss"], 0.0)
    # d/dlp (e^(ref-lp) - (ref-lp) - 1) = 1 - e^(ref-lp)
    torch.testing.assert_close(grad, 0.1 * (1 - delta.exp()) / 8)
    with pytest.raises(ValueError, match="beta=0.1 > 0 needs ref_logprobs"):
        run(ZERO, ZERO, ZERO, torch.zeros(2), cfg=cfg)


def test_token_vs_sequence_aggregation():
    mask = torch.tensor([[True] * 4, [True, True, False, False]])
    adv = torch.tensor([1.0, 4.0])
    token, _, _ = run(ZERO, ZERO, ZERO, adv, mask, cfg={"correction": "none", "loss_type": "bnpo"})
    seq, _, _ = run(ZERO, ZERO, ZERO, adv, mask, cfg={"correction": "none", "loss_type": "grpo"})
    close(token, -(4 * 1 + 2 * 4) / 6)  # -2
    close(seq, -(1 + 4) / 2)  # -2.5
    # a row with no valid token counts as 0 in the sequence mean (TRL's grpo: mean over all rows)
    empty_row = torch.tensor([[True] * 4, [False] * 4])
    seq, _, _ = run(ZERO, ZERO, ZERO, adv, empty_row, cfg={"correction": "none", "loss_type": "grpo"})
    close(seq, -1.0 / 2)


# ----------------------------------------------------------------------------------------------------------------------
# masking, gradients, non-finite values


@pytest.mark.parametrize("loss_type", ["bnpo", "grpo"])  # token-level and sequence-level aggregation
def test_empty_mask_is_zero_loss_with_gradient(loss_type):
    lp = t([[-math.inf, -1.0, -2.0, -3.0], [-math.inf, -1.0, -2.0, -3.0]])  # -inf at prompt positions
    loss, m, grad = run(lp, lp, lp, ADV, torch.zeros(2, 4, dtype=torch.bool), cfg={"loss_type": loss_type})
    assert loss.item() == 0.0 and loss.grad_fn is not None
    assert torch.equal(grad, torch.zeros(2, 4))
    assert all(math.isfinite(v) for v in m.values()) and m["valid_tokens"] == 0


def test_gradients_flow_only_into_logprobs():
    lp = LP.clone().requires_grad_(True)
    old, rollout, ref = (x.clone().requires_grad_(True) for x in (OLD, OLD - 0.1, OLD + 0.2))
    lp_inf = torch.where(torch.tensor([[True, False, False, False]] * 2), -math.inf, lp)  # -inf at a prompt token
    mask = torch.tensor([[False, True, True, True]] * 2)
    loss, _ = policy_loss(lp_inf, old, rollout, ADV, mask, config=LossConfig(beta=0.5), ref_logprobs=ref)
    loss.backward()
    assert old.grad is None and rollout.grad is None and ref.grad is None
    assert lp.grad is not None and lp.grad.isfinite().all() and lp.grad[:, 0].eq(0).all()
    assert lp.grad[:, 1:].ne(0).any()


def test_nonfinite_token_in_mask_is_excluded():
    rollout = OLD.clone()
    rollout[1, 3] = math.nan
    loss, m, grad = run(LP, OLD, rollout, ADV, cfg={"correction": "none"})
    close(m["nonfinite_fraction"], 1 / 8)
    assert m["valid_tokens"] == 7 and grad[1, 3] == 0
    close(loss, (-1.2 - 0.9 - 1.0 - 0.5 + 1.5 + 0.8 + 0.9) / 7)


def test_shape_errors():
    with pytest.raises(ValueError, match=r"old_logprobs has shape \(2, 3\)"):
        policy_loss(ZERO, torch.zeros(2, 3), ZERO, ADV, ALL, config=LossConfig())
    with pytest.raises(ValueError, match="advantages must be"):
        policy_loss(ZERO, ZERO, ZERO, torch.zeros(3), ALL, config=LossConfig())


# ----------------------------------------------------------------------------------------------------------------------
# mismatch_metrics

MISMATCH_KEYS = {
    "abs_diff_mean", "abs_diff_max", "k1", "k2", "k3", "ratio_outside_1.5", "ratio_outside_2", "ratio_outside_5",
    "ratio_outside_10", "trainer_nonfinite_fraction", "rollout_nonfinite_fraction", "num_tokens", "response_tokens",
}  # fmt: skip


def test_mismatch_identical_is_zero():
    lp = t([[-1.0, -2.0, -0.5, -3.0], [-0.1, -0.2, -0.3, -0.4]])
    m = mismatch_metrics(lp, lp.clone(), ALL)
    assert set(m) == MISMATCH_KEYS
    counts = {"num_tokens", "response_tokens"}
    assert {k: v for k, v in m.items() if k not in counts} == dict.fromkeys(MISMATCH_KEYS - counts, 0.0)
    assert m["num_tokens"] == m["response_tokens"] == 8


DELTA = [0.5, -0.5, 1.0, -1.0, 2.0, -3.0]  # trainer - rollout at the 6 masked tokens
SHIFT_MASK = torch.tensor([[True] * 4, [True, True, False, False]])


def shifted() -> tuple[torch.Tensor, torch.Tensor]:
    rollout = t([[-1.0, -2.0, -0.5, -3.0], [-4.0, -0.1, -0.3, -0.4]])
    shift = t([DELTA[:4], DELTA[4:] + [7.0, -7.0]])  # unmasked shifts must not count
    return rollout + shift, rollout


def expected_shift_metrics() -> dict[str, float]:
    return {
        "abs_diff_mean": 8 / 6,
        "abs_diff_max": 3.0,
        "k1": 1 / 6,  # mean(-delta) = -(-1)/6
        "k2": (0.25 + 0.25 + 1 + 1 + 4 + 9) / 2 / 6,
        "k3": sum(math.exp(d) - 1 - d for d in DELTA) / 6,
        "ratio_outside_1.5": 6 / 6,  # |delta| > log 1.5 = 0.405
        "ratio_outside_2": 4 / 6,  # > 0.693
        "ratio_outside_5": 2 / 6,  # > 1.609
        "ratio_outside_10": 1 / 6,  # > 2.303
        "trainer_nonfinite_fraction": 0.0,
        "rollout_nonfinite_fraction": 0.0,
        "num_tokens": 6.0,
        "response_tokens": 6.0,
    }


def test_mismatch_known_shifts():
    trainer, rollout = shifted()
    m = mismatch_metrics(trainer, rollout, SHIFT_MASK)
    assert m == pytest.approx(expected_shift_metrics(), rel=1e-5, abs=1e-6)


def test_mismatch_nonfinite_counted_and_excluded():
    trainer, rollout = shifted()
    trainer = torch.cat([trainer, t([[math.nan, -1.0, -1.0, math.nan]])])
    rollout = torch.cat([rollout, t([[-1.0, -math.inf, -1.0, -1.0]])])
    mask = torch.cat([SHIFT_MASK, torch.tensor([[True, True, False, False]])])  # the last NaN is unmasked
    m = mismatch_metrics(trainer, rollout, mask)
    expected = expected_shift_metrics() | {"trainer_nonfinite_fraction": 1 / 8, "rollout_nonfinite_fraction": 1 / 8,
                                           "response_tokens": 8.0}
    assert m == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_mismatch_empty_mask_is_zero():
    trainer, rollout = shifted()
    m = mismatch_metrics(trainer, rollout, torch.zeros(2, 4, dtype=torch.bool))
    assert m == dict.fromkeys(MISMATCH_KEYS, 0.0)
    assert mismatch_metrics(torch.zeros(0, 0), torch.zeros(0, 0), torch.zeros(0, 0, dtype=torch.bool))["k3"] == 0.0
    with pytest.raises(ValueError, match="shapes differ"):
        mismatch_metrics(trainer, rollout, torch.ones(2, 3, dtype=torch.bool))

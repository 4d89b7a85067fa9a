"""The update guard (asyncrl.train.guard): accepted steps step, rejected ones leave parameters and optimizer state
bit-for-bit as before, and every rank of a DDP or FSDP2 group reaches the same verdict."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.config import GuardConfig
from asyncrl.train.guard import UpdateGuard


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _loss(model: torch.nn.Module, scale: float = 1.0) -> torch.Tensor:
    x = torch.linspace(-1, 1, 16).view(4, 4)
    return model(x).pow(2).mean() * scale


def _state(model, optimizer) -> tuple[list[torch.Tensor], dict]:
    params = [p.detach().clone() for p in model.parameters()]
    opt = {i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
           for i, s in enumerate(optimizer.state.values())}
    return params, opt


def _assert_same(a, b) -> None:
    assert len(a[0]) == len(b[0]) and all(torch.equal(x, y) for x, y in zip(a[0], b[0]))
    assert a[1].keys() == b[1].keys()
    for i in a[1]:
        assert a[1][i].keys() == b[1][i].keys()
        for k in a[1][i]:
            assert torch.equal(a[1][i][k], b[1][i][k]) if isinstance(a[1][i][k], torch.Tensor) else a[1][i][k] == b[1][i][k]


def test_a_finite_step_is_taken_and_clears_gradients():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = _state(model, opt)
    verdict = UpdateGuard(model, opt, GuardConfig(max_update_ratio=0.5)).step(_loss(model))
    assert verdict and verdict.reason == "" and 0 < verdict.update_ratio <= 0.5 and math.isfinite(verdict.grad_norm)
    assert not all(torch.equal(p, b) for p, b in zip(model.parameters(), before[0]))
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("first", [True, False])
def test_a_nan_loss_is_rejected_and_nothing_changes(first):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = UpdateGuard(model, opt, GuardConfig(max_update_ratio=0.5))
    if not first:  # optimizer state exists (moments, step counts) and must come back unchanged
        for _ in range(3):
            assert guard.step(_loss(model))
    before = _state(model, opt)
    verdict = guard.step(_loss(model, scale=float("nan")))
    assert not verdict and "non-finite loss=nan" in verdict.reason
    _assert_same(before, _state(model, opt))
    assert len(opt.state) == (0 if first else 4)
    assert guard.step(_loss(model))  # and the next good step goes through


def test_a_too_large_update_is_undone_exactly():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=100.0, momentum=0.9)
    guard = UpdateGuard(model, opt, GuardConfig(max_update_ratio=0.01), grad_clip=None)
    opt.param_groups[0]["lr"] = 1e-6
    assert guard.step(_loss(model))  # momentum buffers now exist
    opt.param_groups[0]["lr"] = 100.0
    before = _state(model, opt)
    verdict = guard.step(_loss(model))
    assert not verdict and verdict.reason.startswith("update_ratio=") and "guard.max_update_ratio=0.01" in verdict.reason
    assert verdict.update_ratio > 0.01
    _assert_same(before, _state(model, opt))


def test_max_grad_norm_rejects_before_stepping():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = _state(model, opt)
    verdict = UpdateGuard(model, opt, GuardConfig(max_grad_norm=1e-9)).step(_loss(model))
    assert not verdict and "guard.max_grad_norm=1e-09" in verdict.reason and math.isnan(verdict.update_ratio)
    _assert_same(before, _state(model, opt))


def test_a_user_loss_function_returning_nan_is_rejected():
    """A custom loss (``loss.fn``) passes through the same guard: NaN out, parameters unchanged."""

    def user_loss(logp: torch.Tensor, batch: dict) -> torch.Tensor:
        return (logp * batch["advantages"]).mean() / batch["advantages"].sum()  # 0/0 on a batch of zero advantages

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = _state(model, opt)
    logp = model(torch.ones(3, 4)).squeeze(-1)
    verdict = UpdateGuard(model, opt).step(user_loss(logp, {"advantages": torch.zeros(3)}))
    assert not verdict and "non-finite" in verdict.reason
    _assert_same(before, _state(model, opt))


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="guard.max_update_ratio=0"):
        GuardConfig(max_update_ratio=0)
    with pytest.raises(ValueError, match="no parameter with requires_grad"):
        UpdateGuard(torch.nn.Linear(2, 2).requires_grad_(False), torch.optim.SGD([torch.zeros(1, requires_grad=True)]))


def test_the_step_learning_rate_is_set_only_when_kept():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = UpdateGuard(model, opt, GuardConfig(max_update_ratio=1e-3))
    assert not guard.step(_loss(model), lr=50.0)  # too large: undone, and the schedule's lr with it
    assert opt.param_groups[0]["lr"] == 0.1
    assert not guard.step(_loss(model, scale=float("nan")), lr=1e-6)
    assert opt.param_groups[0]["lr"] == 0.1
    assert guard.step(_loss(model), lr=1e-6) and opt.param_groups[0]["lr"] == 1e-6


@pytest.mark.parametrize("chunk_bytes", [1, 1 << 30])
def test_the_update_ratio_is_the_norm_of_the_whole_update(monkeypatch, chunk_bytes):
    """``||theta' - theta|| / ||theta||`` over all trainable parameters together, whether the difference is formed
    one parameter at a time (``RATIO_CHUNK_BYTES`` tiny) or all at once; mixed dtypes included."""
    import asyncrl.train.guard as guard_module

    monkeypatch.setattr(guard_module, "RATIO_CHUNK_BYTES", chunk_bytes)
    model = _model()
    model[2].to(torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.linspace(-1, 1, 16).view(4, 4)
    loss = model[2](model[1](model[0](x)).double()).pow(2).mean()
    verdict = UpdateGuard(model, opt, GuardConfig(max_update_ratio=0.5), grad_clip=None).step(loss)
    diff = sum(float(((p.detach() - b).double() ** 2).sum()) for p, b in zip(model.parameters(), before))
    norm = sum(float((b.double() ** 2).sum()) for b in before)
    assert verdict and verdict.update_ratio == pytest.approx(math.sqrt(diff) / math.sqrt(norm), rel=1e-12)

"""The trainer's AdamW (asyncrl.train.optim.adamw): fused where torch has the kernel, and with it the update guard still
undoes a rejected step bit for bit and a saved optimizer state resumes to the same trajectory."""

from __future__ import annotations

import copy

import torch

from asyncrl.config import GuardConfig
from asyncrl.train.guard import UpdateGuard
from asyncrl.train.optim import adamw


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _loss(model: torch.nn.Module, scale: float = 1.0) -> torch.Tensor:
    return model(torch.linspace(-1, 1, 16).view(4, 4)).pow(2).mean() * scale


def _snapshot(model, opt):
    return ([p.detach().clone() for p in model.parameters()],
            [{k: v.clone() for k, v in s.items()} for s in opt.state.values()])


def test_cpu_float_parameters_get_the_fused_kernel_with_adamw_settings():
    model = _model()
    opt = adamw(list(model.parameters()), lr=1e-3, weight_decay=0.1)
    assert isinstance(opt, torch.optim.AdamW)
    group = opt.param_groups[0]
    assert group["fused"] is True and group["lr"] == 1e-3 and group["weight_decay"] == 0.1


def test_it_takes_the_same_steps_as_the_unfused_adamw():
    fused, plain = _model(), _model()
    f_opt, p_opt = adamw(list(fused.parameters()), lr=1e-2), torch.optim.AdamW(plain.parameters(), lr=1e-2)
    for _ in range(5):
        for model, opt in ((fused, f_opt), (plain, p_opt)):
            opt.zero_grad()
            _loss(model).backward()
            opt.step()
    for a, b in zip(fused.parameters(), plain.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_the_guard_undoes_a_rejected_fused_step_exactly():
    model = _model()
    opt = adamw(list(model.parameters()), lr=1e-3)
    guard = UpdateGuard(model, opt, GuardConfig(max_update_ratio=0.5))
    for _ in range(3):  # moments and the step tensors exist
        assert guard.step(_loss(model))
    before = _snapshot(model, opt)
    verdict = guard.step(_loss(model, scale=float("nan")))
    assert not verdict
    after = _snapshot(model, opt)
    assert all(torch.equal(a, b) for a, b in zip(before[0], after[0]))
    assert [s.keys() for s in before[1]] == [s.keys() for s in after[1]]
    assert all(torch.equal(a[k], b[k]) for a, b in zip(before[1], after[1]) for k in a)
    guard.config.max_update_ratio = 1e-12  # an update the ratio rejects: taken by the kernel, then undone
    verdict = guard.step(_loss(model))
    assert not verdict and verdict.reason.startswith("update_ratio=")
    after = _snapshot(model, opt)
    assert all(torch.equal(a, b) for a, b in zip(before[0], after[0]))
    assert all(torch.equal(a[k], b[k]) for a, b in zip(before[1], after[1]) for k in a)


def test_a_saved_state_resumes_to_the_same_parameters():
    model = _model()
    opt = adamw(list(model.parameters()), lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        _loss(model).backward()
        opt.step()
    params, state = {k: v.clone() for k, v in model.state_dict().items()}, copy.deepcopy(opt.state_dict())
    resumed = _model(seed=1)
    resumed.load_state_dict(params)
    r_opt = adamw(list(resumed.parameters()), lr=1e-2)
    r_opt.load_state_dict(state)
    for m, o in ((model, opt), (resumed, r_opt)):
        for _ in range(3):
            o.zero_grad()
            _loss(m).backward()
            o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed.parameters()))

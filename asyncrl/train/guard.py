"""The update guard: an optimizer step that is taken only if it is sane, and undone exactly if it is not.

One call wraps ``backward`` + ``optimizer.step`` in any training loop (the recipe's, ``recipes/drop_in.py``,
yours)::

    guard = UpdateGuard(model, optimizer, GuardConfig(max_update_ratio=0.05), grad_clip=1.0)
    for batch in loader:
        loss = my_loss(model, batch)             # any loss, a user ``loss.fn`` included
        verdict = guard.step(loss)               # backward, clip, check, step, check, restore if rejected
        sync.commit(accepted=verdict.accepted)   # asyncrl.train.policy_sync: publish + tell the pool, or just commit

A step is rejected when the loss or the gradient norm is not finite, when the gradient norm exceeds
``max_grad_norm``, or when the update moved the parameters by more than ``max_update_ratio``
(``||theta' - theta|| / ||theta||`` over the trainable parameters). A rejected step leaves the parameters and
the optimizer state bit-for-bit as they were before it (a snapshot taken after ``backward``, when FSDP2's
parameters are back in their sharded form, restored in place); the gradients are cleared either way.

Distributed (DDP or FSDP2, any process group): every rank reaches the same verdict. Each check is one small
``all_reduce`` (SUM) of the ranks' local flags and squared sums, so a NaN on one rank rejects the step on all
of them and FSDP2 shards add up to the global norms; DDP replicas are identical, so summing them scales both
norms of the ratio alike. Who blocks on what: :meth:`UpdateGuard.step` waits on those collectives, so every
rank of the group must call it once per step (as it must call ``backward``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from asyncrl.config import GuardConfig

__all__ = ["GuardVerdict", "UpdateGuard"]


@dataclass(frozen=True, slots=True)
class GuardVerdict:
    """What :meth:`UpdateGuard.step` decided (the same on every rank)."""

    accepted: bool
    """The optimizer step was taken and kept."""
    reason: str
    """Why it was rejected, with the values; ``""`` when accepted."""
    loss: float
    """This rank's loss."""
    grad_norm: float
    """The gradient norm before clipping (global: DDP replicas agree, FSDP2's is over all shards)."""
    update_ratio: float
    """``||dtheta|| / ||theta||`` of the step (NaN if no step was taken)."""

    def __bool__(self) -> bool:
        return self.accepted


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor (an FSDP2 DTensor's shard, else the tensor)."""
    return t.to_local() if hasattr(t, "to_local") else t


RATIO_CHUNK_BYTES = 256 << 20
"""The update ratio's ``theta' - theta`` is formed this many bytes of parameters at a time."""


def _squared_norm(tensors: list[torch.Tensor]) -> float:
    """``sum ||t||^2`` over the tensors, accumulated in float64 (each tensor's norm in float64, no float64 copy)."""
    if not tensors:
        return 0.0
    return float(torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float64)).square().sum().cpu())


def _chunks(pairs: list[Any], max_bytes: int) -> list[list[Any]]:
    """``pairs`` (parameter, snapshot) cut into runs of at most ``max_bytes`` of parameters (at least one each)."""
    out: list[list[Any]] = [[]]
    size = 0
    for pair in pairs:
        n = pair[1].numel() * pair[1].element_size()
        if out[-1] and size + n > max_bytes:
            out.append([])
            size = 0
        out[-1].append(pair)
        size += n
    return out


class UpdateGuard:
    """Guards the optimizer steps of one model.

    Args:
        model: the trained module (plain, DDP- or FSDP2-wrapped, peft); its parameters with ``requires_grad``
            are the ones checked and restored.
        optimizer: the optimizer stepping them.
        config: the thresholds.
        grad_clip: clip the gradient norm to this before stepping; None = no clipping.
        group: the process group whose ranks must agree (default: the world, when one is initialised).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: GuardConfig | None = None,
                 *, grad_clip: float | None = 1.0, group: Any = None):
        self.model = model
        self.optimizer = optimizer
        self.config = config or GuardConfig()
        self.grad_clip = grad_clip
        self.group = group
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no parameter with requires_grad=True: nothing to guard")
        self.snapshot: list[torch.Tensor] = []
        """The trainable parameters as they were before the last step (for a debugger's checksum)."""

    # -- the step -----------------------------------------------------------------------------------------------------
    def step(self, loss: torch.Tensor, *, backward: bool = True, lr: float | None = None) -> GuardVerdict:
        """Backward (unless ``backward=False``: the gradients are already there), then the guarded step.

        Args:
            loss: this rank's scalar loss.
            backward: call ``loss.backward()`` first (gradients already accumulated are kept and added to).
            lr: this step's learning rate (a schedule's value), set on every param group only if the step is
                taken; None leaves the param groups alone.

        Returns:
            the verdict; when rejected, parameters and optimizer state are exactly as before the call.
        """
        loss_value = float(loss.detach())
        if backward:
            loss.backward()  # always, even for a NaN loss: DDP/FSDP2 ranks all-reduce inside backward
        self.snapshot = [p.detach().clone() for p in self.params]  # after backward: FSDP2 params are sharded
        optim_state = self._optimizer_snapshot()
        clip = self.grad_clip if self.grad_clip is not None else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, clip))
        bad = self._agree([0.0 if math.isfinite(loss_value) else 1.0, 0.0 if math.isfinite(grad_norm) else 1.0])
        try:
            if bad[0] or bad[1]:
                return GuardVerdict(accepted=False, reason=f"non-finite loss={loss_value} or grad_norm={grad_norm}"
                                    + (" (on another rank)" if math.isfinite(loss_value + grad_norm) else ""),
                                    loss=loss_value, grad_norm=grad_norm, update_ratio=math.nan)
            limit = self.config.max_grad_norm
            if limit is not None and grad_norm > limit:
                return GuardVerdict(accepted=False, reason=f"grad_norm={grad_norm:.4g} > guard.max_grad_norm={limit}",
                                    loss=loss_value, grad_norm=grad_norm, update_ratio=math.nan)
            if lr is not None:
                for group in self.optimizer.param_groups:
                    group["lr"] = lr
            self.optimizer.step()
            ratio = self._update_ratio()
            if math.isfinite(ratio) and ratio <= self.config.max_update_ratio:
                return GuardVerdict(accepted=True, reason="", loss=loss_value, grad_norm=grad_norm, update_ratio=ratio)
            self._restore(optim_state)
            return GuardVerdict(accepted=False, loss=loss_value, grad_norm=grad_norm, update_ratio=ratio,
                                reason=f"update_ratio={ratio:.4g} > guard.max_update_ratio={self.config.max_update_ratio}")
        finally:
            self.optimizer.zero_grad(set_to_none=True)

    # -- machinery ----------------------------------------------------------------------------------------------------
    def _agree(self, values: list[float]) -> list[float]:
        """The SUM over the ranks of ``values`` (this rank's alone without a process group)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(self.group) == 1:
            return [float(v) for v in values]  # a group of one: the sum is this rank's (no collective to wait on)
        t = torch.tensor(values, dtype=torch.float64, device=self._reduce_device())
        dist.all_reduce(t, group=self.group)
        return t.tolist()

    def _reduce_device(self) -> torch.device:
        if dist.is_available() and dist.is_initialized() and dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _update_ratio(self) -> float:
        with torch.no_grad():  # foreach kernels over all tensors (one Python call, not one per parameter)
            before = [_local(b) for b in self.snapshot]
            diff = 0.0
            for chunk in _chunks(list(zip(self.params, before)), RATIO_CHUNK_BYTES):  # bounded temporaries
                after, old = [_local(p.detach()) for p, _ in chunk], [b for _, b in chunk]
                diff += _squared_norm(torch._foreach_sub(after, old))
            norm = _squared_norm(before)
        diff, norm = self._agree([diff, norm])
        return math.sqrt(diff) / max(math.sqrt(norm), 1e-12) if math.isfinite(diff) else math.nan

    def _optimizer_snapshot(self) -> tuple[dict[torch.Tensor, dict[str, Any]], list[dict[str, Any]]]:
        """A copy of the per-parameter optimizer state (tensors cloned; no deepcopy of the whole state dict) and
        of the param groups' settings (lr, betas...: a loop's schedule may have changed them for this step)."""
        state = {p: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                 for p, s in self.optimizer.state.items()}
        return state, [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]

    def _restore(self, optim_state: tuple[dict[torch.Tensor, dict[str, Any]], list[dict[str, Any]]]) -> None:
        state, groups = optim_state
        with torch.no_grad():
            for p, b in zip(self.params, self.snapshot):
                p.copy_(b)
        for p in list(self.optimizer.state):  # a first step created state that did not exist before it
            if p not in state:
                del self.optimizer.state[p]
        for p, s in state.items():
            self.optimizer.state[p] = s
        for group, saved in zip(self.optimizer.param_groups, groups):
            group.update(saved)

"""Fault injection into a rollout worker, so the debugger's tests can prove each detector fires on the
bug it is for (and stays quiet without it). Configured by ``WorkerConfig.fault`` (off by default).

Each fault imitates a real system bug and is applied where that bug would live:

- ``stale_weights``: the worker skips loading weight updates from ``from_version`` on but still
  commits and stamps their version (a failed reload that reports success).
- ``shift_logprobs``: each response token's logprob is reported one position late (the first is 0),
  as an off-by-one in a mask or position ids would.
- ``nan_logprobs``: one logprob per rollout becomes NaN (a numerics bug in the engine).
- ``exploding_reward``: rewards are multiplied by ``scale`` (a broken reward function or environment).

Whether a group is affected is drawn from (group, lease attempt) with probability ``fraction``, so a
group rejected at the pool's gate can pass when it is re-leased. A fault lasts from ``from_version`` to
``until_version`` (exclusive; None: to the end) and may name the next one (``then``): :func:`active` is the fault of
a version.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch

from asyncrl.config import FaultConfig

__all__ = ["active", "affects_group", "corrupt_completion", "corrupt_reward", "skips_weights"]


def active(fault: FaultConfig | None, version: int) -> FaultConfig | None:
    """The fault of the chain ``fault``, ``fault.then``, ... whose window holds ``version``; None outside them all."""
    while fault is not None:
        if fault.kind != "none" and fault.from_version <= version and (
                fault.until_version is None or version < fault.until_version):
            return fault
        fault = fault.then
    return None


def affects_group(fault: FaultConfig, group_id: str, lease_id: int, policy_version: int) -> bool:
    """Whether this attempt at the group is corrupted (by ``active(fault, policy_version)``)."""
    if (fault := active(fault, policy_version)) is None:
        return False
    return fault.fraction >= 1 or zlib.crc32(f"{group_id}/{lease_id}".encode()) / 2**32 < fault.fraction


def skips_weights(fault: FaultConfig, version: int) -> bool:
    """``stale_weights``: this update is committed without being loaded."""
    return (fault := active(fault, version)) is not None and fault.kind == "stale_weights"


def corrupt_completion(fault: FaultConfig, completion: Any) -> None:
    """Applies a logprob fault (the active one: :func:`active`) to one completion in place."""
    lp = completion.logprobs
    if fault.kind == "shift_logprobs" and lp.numel():
        completion.logprobs = torch.cat([lp.new_zeros(1), lp[:-1]])
    elif fault.kind == "nan_logprobs" and lp.numel():
        completion.logprobs = lp.clone()
        completion.logprobs[lp.numel() // 2] = float("nan")


def corrupt_reward(fault: FaultConfig, reward: float) -> float:
    return reward * fault.scale if fault.kind == "exploding_reward" else reward

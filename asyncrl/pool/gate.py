"""The gate: value ranges a decoded group must respect before the pool accepts it.

``Group.from_wire`` checks the wire schema (types, shapes, finite logprobs, consistent spans); the gate
checks what a well-formed but hostile or broken worker can still send, against :class:`GateConfig`:

* rewards (and reward components) finite in float32, the batch dtype (1e39 is finite in float64 and
  inf once collated), and ``|reward| <= gate.max_abs_reward``;
* token ids, prompt and response, in ``[0, gate.vocab_size)`` (always ``[0, 2**31)``);
* logprobs in ``[gate.min_logprob, gate.logprob_tolerance]`` (a logprob of -1e30 is refused);
* images (of image prompts) decode with Pillow within :mod:`asyncrl.data.images`' size limits and match their
  provenance (``metadata["images"]``: sha256 and size), counted as ``image_corrupt``.

Ownership (a group only from the worker that holds, or held, its lease) is checked by the receiver
against the pool (:meth:`~asyncrl.pool.buffer.RolloutPool.held_by`); the policy-version and incarnation
checks are the pool's. Called by the receiver's I/O thread, once per received group; it never blocks.
"""

from __future__ import annotations

import math

import numpy as np

from asyncrl.codec import DecodeError
from asyncrl.config import GateConfig
from asyncrl.data.images import ImageError, verify_images
from asyncrl.rollout import Group, Rollout

__all__ = ["FLOAT32_MAX", "GateError", "check_group"]

FLOAT32_MAX = float(np.finfo(np.float32).max)
MAX_TOKEN_ID = 2**31  # exclusive: ids must fit int32 whatever the vocabulary


class GateError(DecodeError):
    """A rollout outside the gate's ranges; ``reason`` is the counter it is counted under."""

    def __init__(self, reason: str, message: str, uid: str):
        super().__init__(message)
        self.reason = reason
        self.uid = uid
        """The refused rollout's uid."""


def check_group(group: Group, gate: GateConfig) -> None:
    """Checks every rollout of ``group`` against ``gate``.

    Raises:
        GateError: naming the rollout, the value and the setting it violates.
    """
    for r in group.rollouts:
        check_rollout(r, gate)


def check_rollout(r: Rollout, gate: GateConfig) -> None:
    """Checks one rollout's reward, token ids, logprobs and images (see the module docstring).

    Raises:
        GateError: naming the rollout, the value and the setting it violates.
    """
    who = f"{r.uid} (worker {r.worker_id})"
    rewards = [("reward", r.reward), *((f"reward_components[{k!r}]", v) for k, v in r.reward_components.items())]
    for what, value in rewards:
        if not math.isfinite(value) or abs(value) > FLOAT32_MAX:
            raise GateError("reward_not_finite_float32", f"{who}: {what}={value!r} is not finite in float32", r.uid)
        if abs(value) > gate.max_abs_reward:
            error = f"{who}: |{what}|={abs(value)!r} > gate.max_abs_reward={gate.max_abs_reward}"
            raise GateError("reward_out_of_range", error, r.uid)
    limit = MAX_TOKEN_ID if gate.vocab_size is None else gate.vocab_size
    for what, ids in (("prompt_ids", r.prompt_ids), ("response_ids", r.response_ids)):
        if ids.numel():
            a = ids.numpy()
            lo, hi = int(a.min()), int(a.max())
            if lo < 0 or hi >= limit:
                bad = int(np.flatnonzero((a < 0) | (a >= limit))[0])
                raise GateError(
                    "token_id_out_of_range",
                    f"{who}: {what}[{bad}]={int(a[bad])} outside [0, {limit}) "
                    f"(gate.vocab_size={gate.vocab_size})",
                    r.uid,
                )
    if r.logprobs.numel():
        lp = r.logprobs.numpy()
        lo, hi = float(lp.min()), float(lp.max())
        if lo < gate.min_logprob or hi > gate.logprob_tolerance:
            raise GateError(
                "logprob_out_of_range",
                f"{who}: logprobs in [{lo}, {hi}], allowed "
                f"[gate.min_logprob={gate.min_logprob}, gate.logprob_tolerance={gate.logprob_tolerance}]",
                r.uid,
            )
    if r.images:
        try:
            verify_images(r.images, r.metadata.get("images"), what=who)
        except ImageError as e:
            raise GateError("image_corrupt", str(e), r.uid) from None

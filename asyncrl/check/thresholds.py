"""Every stage's pass thresholds, per dtype, in one table, each number with where it comes from.

``asyncrl check --threshold STAGE.KEY=VALUE`` overrides one (e.g. ``--threshold logprobs.max_abs=0.2``);
:func:`thresholds_for` merges the overrides over the dtype's defaults and refuses a key no stage reads, so a
typo cannot silently leave the default in place. Stages read ``ctx.thresholds["stage.key"]``.

Sources of the numbers:

* ``logprobs.*``: :mod:`asyncrl.debug.align`'s measurements on the tiny model. fp32: the HF and vLLM-CPU
  engines agree with the trainer's forward to 2e-7..7e-7 in max ``|dlogp|``; the gate is align's 1e-3,
  which fails only on a real mismatch (weights one update apart give ~0.4). bf16: equal weights still give
  max ``|d|`` ~4e-3, mean ~5e-4, k3 ~3e-7 on the tiny model (both engines), and large models on GPU
  kernels reach a max of 0.1 or more while mean and k3 stay small: the max gate is align's recommended
  0.1, the mean 1e-2 (20x the measured one) and k3 1e-3.
* ``logprobs.topk_max_abs``: the same forward over the engine's top-K tokens instead of the sampled one:
  the same figures, the same gates.
* ``weight_sync.*`` and ``structure.*``: exact (checksums of the bytes; names and shapes): nothing to tune.
* ``parallel.*`` / ``checkpoint.*``: bit for bit (the issue's contract: a full tensor equals the
  single-process one, a resharded load equals the save); ``parallel.forward_max_abs`` allows the
  all-reduce order of a sharded forward: fp32 1e-5, bf16 1e-2 (rounding of one bf16 ulp at logit scale).
* ``loss.pad_max_abs``: one row's logprobs unpadded vs left- and right-padded, and a batch's loss and logprobs with
  extra padding columns and other tokens at its pad positions: the tiny models measure 0 to 5e-7 in fp32 (the
  gate 1e-5 is 20x that); bf16 rounds a logit to ~1e-2, the gate 5e-2. A position or padding mistake moves
  logprobs by 0.1 or more.
* ``loss.grad_norm_max``: a layer's gradient norm on one GRPO step above which it is an offender (exploding):
  the tiny models' layers measure 1e-2..0.6; 1e4 flags only a real blow-up. NaN/inf and exactly-zero gradients
  fail regardless.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["DEFAULTS", "thresholds_for"]

_FP32 = {
    "logprobs.max_abs": 1e-3,
    "logprobs.mean_abs": 1e-4,
    "logprobs.k3": 1e-5,
    "logprobs.topk_max_abs": 1e-3,
    "parallel.max_abs": 0.0,
    "parallel.forward_max_abs": 1e-5,
    "checkpoint.max_abs": 0.0,
    "loss.pad_max_abs": 1e-5,
    "loss.grad_norm_max": 1e4,
}
_BF16 = {
    "logprobs.max_abs": 0.1,
    "logprobs.mean_abs": 1e-2,
    "logprobs.k3": 1e-3,
    "logprobs.topk_max_abs": 0.1,
    "parallel.max_abs": 0.0,
    "parallel.forward_max_abs": 1e-2,
    "checkpoint.max_abs": 0.0,
    "loss.pad_max_abs": 5e-2,
    "loss.grad_norm_max": 1e4,
}
DEFAULTS: dict[str, dict[str, float]] = {"float32": _FP32, "bfloat16": _BF16, "float16": _BF16}
"""Per dtype: ``{"stage.key": value}`` (see the module docstring for each number's source)."""


def thresholds_for(dtype: str, overrides: Mapping[str, float] | None = None) -> dict[str, float]:
    """The dtype's defaults with ``overrides`` applied.

    Raises:
        ValueError: an unknown dtype, or an override key that is not in the table (with the known keys).
    """
    if dtype not in DEFAULTS:
        raise ValueError(f"no thresholds for {dtype=}; choose one of {sorted(DEFAULTS)}")
    out = dict(DEFAULTS[dtype])
    for key, value in (overrides or {}).items():
        if key not in out:
            raise ValueError(f"--threshold {key}={value}: unknown key; known: {sorted(out)}")
        out[key] = float(value)
    return out

"""Fault for tests/integration/test_check_stages.py (``CheckContext.imports``): the trainer's position ids are
shifted by one for left-padded rows (positions 1, 2, ... at the real tokens instead of 0, 1, ...), the off-by-one
of a ``cumsum`` without its ``- 1``. :func:`asyncrl.train.logprobs.token_logprobs` looks ``position_ids`` up at call
time, so the trainer's logprobs of a left-padded row change. The ``loss`` stage must name the positions."""

from __future__ import annotations

import torch

import asyncrl.train.logprobs

_real = asyncrl.train.logprobs.position_ids


def _shifted(attention_mask: torch.Tensor) -> torch.Tensor:
    positions = _real(attention_mask)
    left = attention_mask[:, :1].bool().logical_not() & attention_mask.bool().any(-1, keepdim=True)
    return positions + (left & attention_mask.bool()).long()


asyncrl.train.logprobs.position_ids = _shifted

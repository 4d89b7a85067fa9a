"""Shards: the order of an epoch's prompts and how it is dealt over the trainer ranks.

The global order of epoch ``e`` is ``torch.randperm`` seeded with ``seed + e`` (as ``DistributedSampler``).
:func:`deal` walks it in windows of ``world_size`` prompts and gives one prompt of each window to every rank;
with prompt lengths the longest prompt of a window goes to the rank with the fewest tokens so far (greedy
longest-processing-time), which balances prompt tokens across ranks. A rank's shard is therefore increasing in
the global order, and the shards of all ranks are disjoint and together cover the epoch (less the remainder
``drop_remainder`` leaves out).

Pure functions of their arguments: every rank computes every shard by itself, nothing is exchanged. An elastic
resume (:mod:`asyncrl.pool.reshard`) deals the same way at the new number of ranks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

__all__ = ["all_shards", "deal", "epoch_order", "order_digest", "shard_indices"]


def epoch_order(num_prompts: int, *, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """Every prompt of ``epoch`` in the global order it is dealt in (``range(num_prompts)`` without ``shuffle``)."""
    if not shuffle:
        return list(range(num_prompts))
    g = torch.Generator().manual_seed(seed + epoch)
    return torch.randperm(num_prompts, generator=g).tolist()


def deal(order: Sequence[int], world_size: int, prompt_lengths: Sequence[int] | None = None) -> list[list[int]]:
    """Deals ``order`` over ``world_size`` ranks, one prompt of each window of ``world_size`` to every rank.

    Args:
        order: prompt indices in the order they are dealt (a rank's shard keeps that order).
        world_size: number of ranks.
        prompt_lengths: optional token count of every prompt of the dataset (indexed by prompt index): in each
            window the longest prompt goes to the rank with the fewest tokens so far.

    Returns:
        the shard of each rank (a partial last window gives a prompt to the ranks that have the fewest tokens, or
        the lowest ranks without lengths).
    """
    if world_size < 1:
        raise ValueError(f"{world_size=} must be >= 1")
    if prompt_lengths is None:
        return [list(order[r::world_size]) for r in range(world_size)]
    shards: list[list[int]] = [[] for _ in range(world_size)]
    loads = [0] * world_size
    for start in range(0, len(order), world_size):
        window = sorted(order[start : start + world_size], key=lambda i: -prompt_lengths[i])
        ranks = sorted(range(world_size), key=lambda r: (loads[r], r))
        for idx, r in zip(window, ranks):
            loads[r] += prompt_lengths[idx]
            shards[r].append(idx)
    return shards


def shard_indices(
    num_prompts: int,
    *,
    seed: int,
    epoch: int,
    rank: int,
    world_size: int,
    shuffle: bool = True,
    prompt_lengths: Sequence[int] | None = None,
    drop_remainder: bool = False,
) -> list[int]:
    """This rank's prompts for ``epoch``, in the order they are leased.

    The global order is :func:`epoch_order`, dealt by :func:`deal`. With ``drop_remainder`` every rank gets the same
    count and the last ``num_prompts % world_size`` prompts of the order are skipped.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"{rank=} must be in [0, {world_size=})")
    return all_shards(num_prompts, seed=seed, epoch=epoch, world_size=world_size, shuffle=shuffle,
                      prompt_lengths=prompt_lengths, drop_remainder=drop_remainder)[rank]


def all_shards(
    num_prompts: int,
    *,
    seed: int,
    epoch: int,
    world_size: int,
    shuffle: bool = True,
    prompt_lengths: Sequence[int] | None = None,
    drop_remainder: bool = False,
) -> list[list[int]]:
    """The shard of every rank for ``epoch`` (see :func:`shard_indices`)."""
    if prompt_lengths is not None and len(prompt_lengths) != num_prompts:
        raise ValueError(f"{len(prompt_lengths)=} must equal {num_prompts=}")
    order = epoch_order(num_prompts, seed=seed, epoch=epoch, shuffle=shuffle)
    if drop_remainder:
        order = order[: num_prompts - num_prompts % world_size]
    return deal(order, world_size, prompt_lengths)


def order_digest(order: Sequence[int]) -> str:
    """A short fingerprint of a shard's order (saved with the ledger: a resume onto another order is refused)."""
    return hashlib.blake2b(torch.tensor(list(order), dtype=torch.int64).numpy().tobytes(), digest_size=8).hexdigest()

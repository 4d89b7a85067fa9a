"""Shared test helpers: torchdata's save/load harness, adapted to items that need a key to compare."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torchdata.nodes import BaseNode, Loader


def run_test_save_load_state(node: BaseNode, midpoint: int, key: Callable[[Any], Any] = lambda x: x) -> None:
    """torchdata's ``run_test_save_load_state`` (test/nodes/utils.py): mid-epoch, end-of-epoch and
    next-epoch resume of one node, comparing ``key(item)`` instead of items."""

    def keys(items):
        return [key(x) for x in items]

    x = Loader(node)
    initial_state_dict = x.state_dict()
    it = iter(x)
    results = [next(it) for _ in range(midpoint)]
    state_dict = x.state_dict()
    results += list(it)
    state_dict_0_end = x.state_dict()

    it = iter(x)
    results_1 = [next(it) for _ in range(midpoint)]
    state_dict_1 = x.state_dict()
    results_1 += list(it)
    results, results_1 = keys(results), keys(results_1)
    assert results != results_1, "epochs 0 and 1 must differ (per-epoch order)"

    # restore mid-epoch 0, then the next epoch follows
    x.load_state_dict(state_dict)
    assert keys(x) == results[midpoint:]
    assert keys(x) == results_1

    # restore mid-epoch 1
    x.load_state_dict(state_dict_1)
    assert keys(x) == results_1[midpoint:]

    # restore the initial state: both epochs again
    x.load_state_dict(initial_state_dict)
    assert keys(x) == results
    assert keys(x) == results_1

    # restore end of epoch 0 without restart: nothing; with restart: epoch 1
    x = Loader(node, restart_on_stop_iteration=False)
    x.load_state_dict(state_dict_0_end)
    assert keys(x) == []
    x = Loader(node)
    x.load_state_dict(state_dict_0_end)
    assert keys(x) == results_1


class FakeSender:
    """A rollout sender that keeps what a worker sends: ``(lease_id, group)`` per group, ``(lease_id, error)`` per
    failed lease and the culprit each failure names."""

    def __init__(self):
        self.groups, self.failed, self.status, self.done = [], [], {}, False
        self.culprits = []

    def send_group(self, lease, group):
        self.groups.append((lease.lease_id, group))

    def send_failed(self, lease, error, culprit=None):
        self.failed.append((lease.lease_id, error))
        self.culprits.append(culprit)

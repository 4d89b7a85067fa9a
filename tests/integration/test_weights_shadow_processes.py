"""Shadow weights across processes: a receiver SIGKILLed while it fills its engine's shadow never commits; the other
receiver swaps version 2 in, then version 3 through the refilled shadow, bit for bit.

Same drivers as ``test_weights_processes`` (``_weights_driver.py``), each with ``--shadow``: engine tensors laid out
like version 2 (64 MiB in ~60 buckets of 1 MiB). Version 1 (another layout) goes the usual way, as views.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from asyncrl.weights import setup_weight_broadcaster
from tests.integration.test_weights_processes import MB, TIMEOUT_S, Driver, assert_eventually, big_state_dict, crcs

pytestmark = pytest.mark.integration


def test_receiver_killed_mid_shadow_fill_never_commits_and_the_next_version_lands(tmp_path):
    import torch

    deadline = time.monotonic() + TIMEOUT_S
    b = setup_weight_broadcaster("shm", bucket_bytes=MB)
    v2 = big_state_dict()
    v3 = {k: t + 1 for k, t in v2.items()}
    spec = json.dumps({k: [str(t.dtype).removeprefix("torch."), list(t.shape)] for k, t in v2.items()})
    survivor = victim = None
    try:
        b.publish({"w": torch.ones(16)}, 1)
        survivor = Driver("shm", b.address, "survivor", tmp_path / "survivor.log", "--shadow", spec,
                          "--versions", "1,2,3")
        victim = Driver("shm", b.address, "victim", tmp_path / "victim.log", "--delay", "0.05", "--shadow", spec)
        for d in (survivor, victim):
            assert not d.until("staged", deadline, version=1)["via_shadow"]  # not the shadow's layout: views
            d.until("committed", deadline, version=1)

        stats = b.publish(v2, 2)
        progress = victim.until("progress", deadline, version=2)
        while progress["bytes"] < 4 * MB:  # a few buckets into its shadow, far from done
            progress = victim.until("progress", deadline, version=2)
        assert progress["bytes"] < stats["bytes"] // 2
        os.kill(victim.proc.pid, signal.SIGKILL)
        assert victim.proc.wait(10) == -signal.SIGKILL

        staged = survivor.until("staged", deadline, version=2)
        assert staged["via_shadow"] and staged["checksums"] == crcs(v2)  # read from the engine tensors after the swap
        survivor.until("committed", deadline, version=2)
        b.publish(v3, 3)  # into the shadow that now holds version 1's storage
        staged = survivor.until("staged", deadline, version=3)
        assert staged["via_shadow"] and staged["checksums"] == crcs(v3)
        survivor.until("committed", deadline, version=3)
        assert survivor.proc.wait(20) == 0, survivor.log.read_text()[-2000:]
        assert_eventually(lambda: b.committed().get("survivor") == 3, deadline)
        assert b.committed() == {"survivor": 3, "victim": 1}  # the victim never reached phase two of v2
        assert b.stats()["slots_replaced"] == 0, b.stats()  # the dead receiver's hold went with it
    finally:
        for d in (survivor, victim):
            if d is not None:
                d.stop()
        b.close()

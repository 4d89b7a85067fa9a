"""A worker fed a poisoned prompt: its log stays bounded (asyncrl._logging.Throttle) and one bad prompt does
not fail its batch-mates. In-process, with the fake engine and a small fake of the sender."""

from __future__ import annotations

import logging

from asyncrl._logging import Throttle
from asyncrl.config import FakeEngineConfig
from asyncrl.rewards.legacy import fake_reward
from asyncrl.transport import ReceivedLease
from tests.utils import FakeSender
from workers.engines import build_engine
from workers.worker import RolloutWorker

POISON = {"foo": 1}


def lease(lease_id: int, prompt) -> ReceivedLease:
    return ReceivedLease(conn=0, lease_id=lease_id, epoch=0, prompt_index=lease_id, group_size=2, prompt=prompt,
                         policy_version=0)


def worker() -> tuple[RolloutWorker, FakeSender]:
    sender = FakeSender()
    return RolloutWorker("w0", build_engine(FakeEngineConfig()), fake_reward, sender, max_batch=4), sender


def test_a_worker_fed_a_poisoned_prompt_logs_a_bounded_number_of_lines(caplog):
    w, sender = worker()
    with caplog.at_level(logging.DEBUG, logger="workers.worker"):
        for i in range(2000):  # the pool re-issuing the prompt as fast as it can
            w.step([lease(i + 1, POISON)])
    assert len(sender.failed) == 2000 and all("an engine needs a prompt with" in e for _, e in sender.failed)
    lines = [r for r in caplog.records if r.name == "workers.worker"]
    assert len(lines) <= 5, [r.getMessage() for r in lines]  # 3 in the burst, then one per 10 s
    assert w.lease_failures == 2000 and w.throttle.suppressed_total >= 1995


def test_one_poisoned_prompt_does_not_fail_its_batch():
    w, sender = worker()
    w.step([lease(1, {"prompt_ids": [1, 2, 3]}), lease(2, POISON), lease(3, {"text": "hi"})])
    assert [lid for lid, _ in sender.groups] == [1, 3]
    assert [lid for lid, _ in sender.failed] == [2]


def test_throttle_logs_a_burst_then_one_line_per_interval_with_the_count(caplog):
    now = [0.0]
    throttle = Throttle(logging.getLogger("t"), burst=2, interval_s=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="t"):
        for i in range(100):
            now[0] = i * 1.0  # one a second for 100 s
            throttle.warning("k", "failed %d", i)
        throttle.warning("other", "another kind")
    messages = [r.getMessage() for r in caplog.records]
    assert messages[:2] == ["failed 0", "failed 1 [repeated 2 times; from now on at most one line per 10 s]"]
    assert messages[2] == "failed 11 [9 similar lines suppressed]"
    assert len(messages) == 2 + 9 + 1 and messages[-1] == "another kind"
    assert throttle.suppressed_total == 100 - 2 - 9

"""Local worker restarts through the loader: a worker that crashes at start-up is restarted
``loader.restart_workers`` times (with backoff, counted), then ``next()`` raises the clear "all workers dead"
error, with the worker's last stderr lines, instead of waiting forever. (Unlimited restarts and the backoff's growth:
tests/integration/test_launcher.py; a worker given up after the same start-up error: test_worker_start_failures.py.)"""

from __future__ import annotations

import sys
import textwrap

import pytest

from asyncrl import LoaderConfig, RolloutLoader, TransportConfig, WorkerConfig

pytestmark = pytest.mark.integration


def test_n_restarts_then_next_raises_all_workers_dead(tmp_path, monkeypatch):
    # a reward the trainer imports (its check passes) and every worker process fails to: each dies on start-up
    (tmp_path / "judge.py").write_text(textwrap.dedent("""
        import os, sys
        if sys.argv[0].endswith(os.path.join("workers", "__main__.py")):
            raise RuntimeError("this judge runs in the trainer only")
        def reward(completions, **kwargs):
            return [0.0 for _ in completions]
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "judge", raising=False)  # another test's judge.py, imported in this process
    config = LoaderConfig(
        group_size=2,
        batch_size=2,
        num_workers=1,
        restart_workers=2,
        max_failed_starts=None,  # restart_workers alone decides (the same error each time would give up earlier)
        restart_backoff_s=0.05,
        poll_timeout_s=0.2,
        wait_timeout_s=300,  # a bound on the test, never reached when the loader gives up as it should
        transport=TransportConfig(heartbeat_s=0.2, peer_timeout_s=5),
        worker=WorkerConfig(reward="judge:reward"),
    )
    with RolloutLoader([{"prompt_ids": [1, 2, 3]}] * 4, config) as loader:
        with pytest.raises(RuntimeError, match=r"all 1 local rollout workers are dead.*restart_workers=2") as info:
            next(iter(loader))
        workers = loader.stats()["workers"]
    assert "restarts used per slot: [2]" in str(info.value)
    assert "RuntimeError: this judge runs in the trainer only" in str(info.value)  # its last stderr lines
    assert workers["restarts"] == [2] and workers["deaths"] == [3] and workers["alive"] == 0
    assert workers["last_restart_delay_s"] == [0.1]  # the second restart waited twice the first

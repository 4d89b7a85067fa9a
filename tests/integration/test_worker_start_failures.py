"""Workers that cannot start, with real worker processes: a worker that dies before its first group with the same
error each time is restarted ``max_failed_starts`` - 1 times, not forever, and ``next(loader)`` raises its error with
its last stderr lines (which still reach the trainer's stderr). The trainer-side checks that catch most such set-ups
before any process starts are in tests/unit/datapipes/test_fail_fast.py; here are the failures only a worker process can show:
a dependency missing where the workers run, a model whose files pass the path check but do not load."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from asyncrl import (HFEngineConfig, LoaderConfig, RolloutLoader, TransportConfig, WeightSyncConfig, WorkerConfig,
                     setup_weight_broadcaster)
from asyncrl.testing.tiny_model import build_tiny_model
from workers.launcher import WorkerStartError

pytestmark = pytest.mark.integration

PROMPTS = [{"prompt_ids": [1 + i, 2, 3], "text": f"{i}+1=", "answer": str(i + 1)} for i in range(8)]


def _config(**worker) -> LoaderConfig:
    return LoaderConfig(group_size=2, batch_size=2, num_workers=1, restart_backoff_s=0.05, poll_timeout_s=0.2,
                        max_failed_starts=2,  # the default is 3 (tests/integration/test_launcher.py); two cold starts here
                        wait_timeout_s=300,  # a bound on the test: the loader gives up long before
                        transport=TransportConfig(heartbeat_s=0.2, peer_timeout_s=5), worker=WorkerConfig(**worker))


def test_a_reward_whose_dependency_the_workers_lack_raises_its_error_from_next(tmp_path, monkeypatch, capfd):
    # importable in the trainer (its check passes), not where the workers run: a worker dies at start every time
    (tmp_path / "judge.py").write_text(textwrap.dedent("""
        import os, sys
        if sys.argv[0].endswith(os.path.join("workers", "__main__.py")):  # a rollout worker process
            import gpu_only_dependency  # noqa: F401
        def score(completions, **kwargs):
            return [0.0 for _ in completions]
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "judge", raising=False)  # another test's judge.py, imported in this process
    with RolloutLoader(PROMPTS, _config(reward="judge:score")) as loader:
        with pytest.raises(WorkerStartError) as info:
            next(iter(loader))
        workers = loader.stats()["workers"]
    error = info.value
    assert str(error).startswith("rollout worker r0w-0 cannot start: it died 2 times in a row before its first group, "
                                 "each time with: ModuleNotFoundError: No module named 'gpu_only_dependency'")
    assert "judge.py\", line 4, in <module>" in error.stderr  # the worker's own last stderr lines
    assert workers["deaths"] == [2] and workers["restarts"] == [1] and workers["failed_starts"] == [2]
    assert workers["alive"] == 0 and workers["pending_restarts"] == []  # not "restart 4 of unlimited"
    assert capfd.readouterr().err.count("No module named 'gpu_only_dependency'") >= 2  # still shown as it happens


@pytest.mark.slow  # two HF worker starts (torch + transformers imports each)
def test_an_hf_model_that_passes_the_path_check_but_does_not_load_raises_from_next(tmp_path):
    model = build_tiny_model(tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "hidden_size": 96}))  # another model's config
    weights = setup_weight_broadcaster("shm")
    try:
        engine = HFEngineConfig(model=str(model), max_new_tokens=4)
        with RolloutLoader(PROMPTS, _config(engine=engine, reward="arithmetic",
                                            weights=WeightSyncConfig(type="shm", address=weights.address))) as loader:
            with pytest.raises(WorkerStartError, match=r"r0w-0 cannot start: it died 2 times in a row before its "
                                                       r"first group, each time with: .*size"):
                next(iter(loader))
    finally:
        weights.close()

"""End to end with real engines: one RolloutLoader served by 2 vLLM workers and 1 HF worker
(started as `asyncrl worker --connect ...` processes) on the tiny model yields well-formed batches
whose rollout logprobs match the trainer's forward pass."""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import time

import pytest

from asyncrl import LoaderConfig, RolloutLoader, TransportConfig
from asyncrl.data.tasks import arithmetic_prompts
from asyncrl.testing.tiny_model import build_tiny_model
from asyncrl.train.logprobs import token_logprobs
from tests.engine_utils import SAMPLING, TOL, load_model

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.slow]


def _worker(endpoint: str, worker_id: str, engine: str, model_dir: str) -> subprocess.Popen:
    sets = {
        "worker.engine.type": engine,
        "worker.engine.model": model_dir,
        "worker.engine.max_new_tokens": 8,
        "worker.engine.temperature": SAMPLING["temperature"],
        "worker.engine.top_k": SAMPLING["top_k"],
        "worker.engine.top_p": SAMPLING["top_p"],
        "worker.reward": "arithmetic",
        "worker.slots": 2,
        "transport.heartbeat_s": 0.5,
        "transport.peer_timeout_s": 60,
        "transport.handshake_timeout_s": 300,
    }
    argv = [sys.executable, "-m", "asyncrl.cli", "worker", "--connect", endpoint, "--worker-id", worker_id]
    for k, v in sets.items():
        argv += ["--set", f"{k}={v}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _wait_for_workers(loader: RolloutLoader, procs: list[subprocess.Popen], n: int, timeout: float = 400) -> None:
    deadline = time.monotonic() + timeout
    while len(loader.stats()["transport"]["workers"]) < n:
        for p in procs:
            if p.poll() is not None:
                pytest.fail(f"worker exited with {p.returncode}: {p.stderr.read()[-3000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"only {loader.stats()['transport']['workers']} joined within {timeout} s")
        time.sleep(0.5)


def test_two_vllm_and_one_hf_worker_feed_one_loader(tmp_path):
    model_dir = str(build_tiny_model(tmp_path / "tiny"))
    config = LoaderConfig(
        group_size=2,
        batch_size=4,
        capacity=12,
        max_staleness=None,
        wait_timeout_s=300,
        transport=TransportConfig(heartbeat_s=0.5, peer_timeout_s=60),
    )
    prompts = arithmetic_prompts(36, seed=1)
    procs = []
    try:
        with RolloutLoader(prompts, config) as loader:
            procs = [
                _worker(loader.endpoint, "vllm-0", "vllm", model_dir),
                _worker(loader.endpoint, "vllm-1", "vllm", model_dir),
                _worker(loader.endpoint, "hf-0", "hf", model_dir),
            ]
            _wait_for_workers(loader, procs, 3)  # no lease is granted before iteration starts
            batches = list(loader)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
    model = load_model(model_dir)
    by_worker = collections.Counter()
    for batch in batches:
        rows = batch["input_ids"].shape[0]
        assert batch["attention_mask"].shape == batch["loss_mask"].shape == (rows, batch["input_ids"].shape[1])
        assert batch["rewards"].shape == (rows,) and batch["rewards"].isfinite().all()
        assert (batch["loss_mask"] <= batch["attention_mask"]).all()
        mask = batch["loss_mask"]
        ours = token_logprobs(model, batch["input_ids"], batch["attention_mask"], **SAMPLING)
        assert (ours[mask] - batch["rollout_logprobs"][mask]).abs().max().item() <= TOL
        by_worker.update(batch["worker_ids"])
    assert sum(len(b["group_ids"]) for b in batches) == 36
    assert {w.split("-")[0] for w in by_worker} == {"vllm", "hf"}, by_worker

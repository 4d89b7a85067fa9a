"""Engines follow the config: each local worker slot gets its own device (dealt over every rank's slots), the worker
process pins itself to it (CUDA_VISIBLE_DEVICES, the engine on the first GPU it sees), and the vLLM settings a GPU
user needs are config fields that reach ``vllm.LLM``."""

from __future__ import annotations

import pytest

from asyncrl.config import HFEngineConfig, TransportConfig, VllmEngineConfig, WorkerConfig
from workers.launcher import LocalWorkerLauncher, pin_device


def test_pin_device_maps_through_the_gpus_the_process_sees():
    env: dict[str, str] = {}
    assert pin_device("cuda:3", env) == "cuda:0" and env["CUDA_VISIBLE_DEVICES"] == "3"
    env = {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    assert pin_device("cuda:1,2", env) == "cuda:0" and env["CUDA_VISIBLE_DEVICES"] == "5,6"
    env = {"CUDA_VISIBLE_DEVICES": "4,5"}
    assert pin_device("cpu", env) == "cpu" and pin_device("cuda", env) == "cuda" and env["CUDA_VISIBLE_DEVICES"] == "4,5"
    with pytest.raises(ValueError, match=r"sees only 2 GPUs"):
        pin_device("cuda:2", {"CUDA_VISIBLE_DEVICES": "4,5"})
    with pytest.raises(ValueError, match="must be 'cpu'"):
        pin_device("gpu:0", {})


def test_slots_of_every_rank_get_their_own_device():
    worker = WorkerConfig(devices=["cuda:0", "cuda:1", "cuda:2", "cuda:3"])
    ranks = [LocalWorkerLauncher(["tcp://127.0.0.1:1"], 2, worker, TransportConfig(), name=f"r{r}w", device_offset=2 * r)
             for r in range(2)]
    assert [lau.device(i) for lau in ranks for i in range(2)] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    argv = ranks[1]._argv(1)
    assert argv[argv.index("--device") + 1] == "cuda:3"
    plain = LocalWorkerLauncher(["tcp://127.0.0.1:1"], 1, WorkerConfig(), TransportConfig())
    assert plain.device(0) is None and "--device" not in plain._argv(0)


def test_the_worker_command_pins_itself_before_its_engine_starts(monkeypatch):
    import workers.worker
    from asyncrl.cli import main

    seen = {}

    def fake_run_worker(endpoints, config, transport, **kw):
        import os

        seen.update(device=config.engine.device, visible=os.environ.get("CUDA_VISIBLE_DEVICES"))

    monkeypatch.setattr(workers.worker, "run_worker", fake_run_worker)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    main(["worker", "--connect", "tcp://127.0.0.1:1", "--device", "cuda:1", "--set", "worker.engine.type=hf"])
    assert seen == {"device": "cuda:0", "visible": "3"}


def test_device_and_engine_settings_are_checked():
    with pytest.raises(ValueError, match="worker.devices entry 'gpu1'"):
        WorkerConfig(devices=["gpu1"])
    with pytest.raises(ValueError, match="names 2 GPUs but engine.tensor_parallel_size=1"):
        WorkerConfig(devices=["cuda:0,1"], engine=VllmEngineConfig())
    WorkerConfig(devices=["cuda:0,1"], engine=VllmEngineConfig(tensor_parallel_size=2))
    with pytest.raises(ValueError, match="engine.dtype='fp8'"):
        HFEngineConfig(dtype="fp8")
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        VllmEngineConfig(gpu_memory_utilization=0)

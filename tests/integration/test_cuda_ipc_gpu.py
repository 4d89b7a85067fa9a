"""The cuda_ipc weight backend on a real GPU (skipped without CUDA): a trainer process publishes a small Qwen-shaped
bf16 model, a worker process opens the slots once at start-up and applies four versions into engine tensors that
live in one flat buffer; every version's engine tensors equal the published ones (word sums), nothing fails. With
two GPUs, the nccl backend between them the same way. The
device pieces on their own: the slot checksum on CUDA equals the CPU's, and an exported handle survives msgpack.
The protocol's hostile cases run without CUDA in ``tests/integration/test_cuda_ipc_weights.py``; the 1.5B figure comes from
``benchmarks/gpu_weight_sync.py`` (``benchmarks/gpu_checks.sh``)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.integration]


def test_versions_reach_an_engine_in_another_process_verified():
    from benchmarks.gpu_weight_sync import run

    result = run("cuda_ipc", layers=2, vocab=1024, trials=4)
    assert result["summary"]["all_verified"], result["rows"]
    assert [r["version"] for r in result["rows"]] == [1, 2, 3, 4]
    worker = result["worker_stats"]
    assert worker["failures"] == 0 and worker["slots_opened"] == 2 and worker["versions_committed"] == 4
    assert result["broadcaster_stats"].get("slots_replaced", 0) == 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL refuses two ranks on one GPU")
def test_nccl_weights_between_two_gpus_verified():
    from benchmarks.gpu_weight_sync import run

    result = run("nccl", layers=2, vocab=1024, trials=3, nccl_device="cuda:1", wait_s=60)
    assert result["summary"]["all_verified"], result["rows"]
    assert result["worker_stats"]["failures"] == 0


def test_the_slot_checksum_is_the_same_on_cuda_and_cpu():
    from asyncrl.weights._ipc_memory import word_sum

    data = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
    assert int(word_sum(data.cuda())) == int(word_sum(data))


def test_an_exported_handle_survives_the_wire():
    from asyncrl.codec import decode, encode
    from asyncrl.weights._ipc_memory import CudaIpcMemory, IpcHandle

    memory = CudaIpcMemory(0)
    buf = memory.alloc(1 << 16)
    wire = memory.export(buf)
    _, body = decode(encode("h", wire))
    h = IpcHandle.from_wire(body)
    assert h.numel == 1 << 16 and h.to_wire() == wire
    assert h.device_uuid == str(torch.cuda.get_device_properties(0).uuid)

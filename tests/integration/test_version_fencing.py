"""Version fencing end to end: real HF workers, real weight broadcaster, real loader.

The trainer interleaves consumption with several weight updates. Every rollout's
``policy_version`` must be the version whose weights produced it: recomputing its logprobs under
that version's weights matches to 1e-4, and under any other version it does not.
"""

from __future__ import annotations

import time

import pytest
import torch

from asyncrl import HFEngineConfig, LoaderConfig, RolloutLoader, TransportConfig, WorkerConfig
from asyncrl.config import WeightSyncConfig
from asyncrl.testing.tiny_model import build_tiny_model
from asyncrl.train.logprobs import token_logprobs
from asyncrl.weights import setup_weight_broadcaster
from tests.engine_utils import TOL, load_model, perturbed

pytestmark = pytest.mark.integration

UPDATES = 3
SAMPLING = dict(temperature=0.8, top_k=0, top_p=1.0)
"""No truncation: with top_p=0.95 a token whose cumulative probability sits within float error of the cut
flips in or out of the nucleus between the engine's forward and the trainer's, and the sampled token's
logprob moves by log(1 / (1 - p_flipped)). Seen in 2 of 7 runs, both times diff=0.02663 on a version-1
rollout, while no other version matched it either: consistent with one flipped token of mass 0.026; 0 of 6
runs failed without truncation. A fencing test measures versions, not nucleus boundaries; processed logprobs under top-k/top-p
are checked by the engine tests and ``asyncrl align``."""


def _hf_streams() -> bool:
    from workers.engines.hf import HFEngine

    return bool(getattr(HFEngine, "streaming", False))


@pytest.mark.parametrize("backend,streaming,shadow", [
    ("zmq", False, False),
    # make test: a static worker's fencing is zmq-False-False's and shm-shadow's (shm, static); the shm receiver's
    # copy into the engine (no shadow) is shm-True-False's, the same apply_weights checked per token span
    pytest.param("shm", False, False, marks=pytest.mark.extended),
    pytest.param("shm", False, True, marks=pytest.mark.slow, id="shm-shadow"),
    pytest.param("shm", True, False,
                 marks=pytest.mark.skipif(not _hf_streams(), reason="the HF engine does not stream yet")),
])
def test_every_rollout_carries_the_version_that_produced_it(tmp_path, backend, streaming, shadow):
    """Static: whole rollouts per version. Streaming: updates land in flight, so a rollout's tokens may span
    versions; every token is checked against the weights of its own span (``token_versions``). Shadow: the
    workers' receivers fill their engines' shadow weights, swapped in at the same safe point (``weights.shadow``);
    each version is published once both workers applied the previous one, so every version, the first included,
    must be swapped in (``weights_via_shadow`` in the workers' statuses), none staged as views (``shadow_busy``)."""
    model_dir = str(build_tiny_model(tmp_path / "tiny"))
    base = load_model(model_dir)
    versions = {0: base.state_dict()}
    for v in range(1, UPDATES + 1):
        versions[v] = perturbed(base, scale=0.1, seed=v)
    broadcaster = setup_weight_broadcaster(backend)
    broadcaster.publish(versions[0], 0)
    config = LoaderConfig(
        group_size=2,
        batch_size=2,
        capacity=4,
        max_staleness=None,
        num_workers=2,
        wait_timeout_s=120,
        transport=TransportConfig(heartbeat_s=0.2, peer_timeout_s=20),
        worker=WorkerConfig(
            slots=2 if streaming else 1,
            max_batch=1,
            streaming=streaming,
            engine=HFEngineConfig(model=model_dir, max_new_tokens=12, **SAMPLING),
            weights=WeightSyncConfig(type=backend, address=broadcaster.address, shadow=shadow),
        ),
    )
    prompts = [{"text": f"{i}+{i % 5}="} for i in range(40)]
    batches = []
    try:
        with RolloutLoader(prompts, config) as loader:
            for step, batch in enumerate(loader):
                batches.append(batch)
                if step % 4 == 3 and loader.policy_version < UPDATES:
                    v = loader.policy_version + 1
                    if shadow:  # every worker applied v - 1 (its shadow released): v must go through the shadow
                        _until_workers(loader, lambda w, v=v: w.get("policy_version", -1) >= v - 1, f"at version {v - 1}")
                    broadcaster.publish(versions[v], v)
                    loader.set_policy_version(v)
            committed = broadcaster.committed()
            if shadow:  # every version was swapped in, the first (a late joiner's fill) too; none went as views
                workers = _until_workers(loader, lambda w: w.get("weights_via_shadow") == UPDATES + 1,
                                         f"swapped in all {UPDATES + 1} versions")
                assert all(w["shadow_busy"] == 0 for w in workers.values()), workers
    finally:
        broadcaster.close()

    seen = set()
    models = {}
    for batch in batches:
        token_versions = batch["token_versions"]
        for v in token_versions[token_versions >= 0].unique().tolist():
            tokens = batch["loss_mask"].bool() & (token_versions == v)  # the tokens version v produced
            rows = tokens.any(dim=1)
            seen.add(v)
            ids, attn, mask = batch["input_ids"][rows], batch["attention_mask"][rows], tokens[rows]
            rollout_lp = batch["rollout_logprobs"][rows][mask]
            for other, state in versions.items():
                model = models.setdefault(other, _model(model_dir, state))
                diff = (token_logprobs(model, ids, attn, **SAMPLING)[mask] - rollout_lp).abs().max().item()
                if other == v:
                    assert diff <= TOL, f"rollouts stamped v{v} do not match v{v}'s weights ({diff=})"
                else:
                    assert diff > 10 * TOL, f"rollouts stamped v{v} also match v{other}: the test cannot tell versions apart"
    assert len(seen) >= 2, f"only versions {seen} were consumed; the run did not interleave updates"
    assert committed and all(v >= 1 for v in committed.values()), committed


def _until_workers(loader: RolloutLoader, check, what: str, timeout: float = 60.0) -> dict:
    """Both workers' statuses (``loader.stats()["transport"]["workers"]``, heartbeats) once ``check`` holds for each."""
    deadline = time.monotonic() + timeout
    while True:
        workers = loader.stats()["transport"]["workers"]
        if len(workers) == 2 and all(check(w) for w in workers.values()):
            return workers
        assert time.monotonic() < deadline, f"the workers were never {what}: {workers}"
        time.sleep(0.05)


def _model(model_dir: str, state: dict) -> torch.nn.Module:
    model = load_model(model_dir)
    model.load_state_dict(state)
    return model

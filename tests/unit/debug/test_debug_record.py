"""The per-step record and the detectors on synthetic batches: summaries are exact and bounded, each
detector fires on its bug and stays quiet on a healthy sequence, worker faults corrupt what they say."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.config import DebugConfig, FaultConfig
from asyncrl.debug.detectors import AnomalyDetectors, Debugger
from asyncrl.debug.dump import read_dump
from asyncrl.debug.record import FIXED_EDGES, read_records, step_record, summarize
from asyncrl.rollout import Group, Rollout
from datapipes.collate import collate_groups
from workers import faults
from workers.engines.base import Completion


def test_summarize_is_exact_and_counts_nonfinite():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0, float("nan"), float("inf")])
    s = summarize(x)
    assert s["n"] == 4 and s["nonfinite"] == 2
    assert s["mean"] == 2.5 and s["min"] == 1.0 and s["max"] == 4.0 and s["q"]["50"] == 2.5
    assert sum(s["hist"]["counts"]) == 4 and len(s["hist"]["counts"]) == len(s["hist"]["edges"]) + 1
    fixed = summarize(torch.tensor([-2.0, 0.0, 5e-7, 0.5]), FIXED_EDGES["logprob_diff"])
    assert fixed["hist"]["edges"] == FIXED_EDGES["logprob_diff"] and sum(fixed["hist"]["counts"]) == 4
    assert fixed["hist"]["counts"][0] == 1  # -2 < -1: the open first bin
    empty = summarize(torch.tensor([]))
    assert empty["n"] == 0 and empty["mean"] is None


def _batch(rewards=None, shift=0.0, version=3, worker="w0"):
    groups = []
    for p in range(2):
        rollouts = [Rollout(epoch=0, prompt_index=p, sample_index=s, worker_id=worker, policy_version=version,
                            prompt_ids=torch.tensor([1, 2], dtype=torch.int32),
                            response_ids=torch.tensor([3, 4, 5], dtype=torch.int32),
                            logprobs=torch.tensor([-0.5, -1.0, -0.25]), reward=float(s % 2) if rewards is None else rewards,
                            timings={"generate": 0.1}) for s in range(4)]
        groups.append(Group(epoch=0, prompt_index=p, rollouts=rollouts))
    batch = collate_groups(groups)
    trainer = batch["rollout_logprobs"] + shift * batch["loss_mask"]
    return batch, trainer


def _record(batch, trainer, version=3, accepted=True, step=1):
    return step_record(step=step, rank=0, policy_version=version, batch=batch, trainer_logprobs=trainer,
                       advantages=torch.zeros(8), accepted=accepted, guard_reason="" if accepted else "too big",
                       loss=0.1, grad_norm=1.0, update_ratio=0.01)


def test_step_record_fields_and_bounded_size():
    batch, trainer = _batch()
    r = _record(batch, trainer)
    assert r["dist"]["logprob_diff_onpolicy"]["n"] == 24 and r["dist"]["logprob_diff"]["max"] == 0.0
    assert r["version_lag"]["hist"][0] == 8 and r["workers"]["w0"]["rollouts"] == 8
    assert r["uids"][0] == "e0-p0-s0" and r["rollout_versions"] == {"min": 3, "max": 3}
    lagging = _record(batch, trainer, version=5)
    assert lagging["version_lag"]["max"] == 2 and lagging["dist"]["logprob_diff_onpolicy"]["n"] == 0
    import orjson

    assert len(orjson.dumps(r)) < 8000


def _healthy_history(det, steps=6):
    for step in range(1, steps + 1):
        batch, trainer = _batch(shift=1e-7 * step)
        assert det.check(_record(batch, trainer, step=step)) == []


@pytest.mark.parametrize("bug,kind", [
    ("shift", "logprob_mismatch"), ("reward", "reward_shift"), ("lag", "version_lag"),
    ("nan", "nonfinite"), ("reject", "guard_rejection"), ("gate", "rejected_rollouts"),
])
def test_each_detector_fires_on_its_bug(bug, kind):
    det = AnomalyDetectors(DebugConfig(), max_staleness=0)
    _healthy_history(det)
    batch, trainer = _batch(shift=0.3 if bug == "shift" else 0.0, rewards=500.0 if bug == "reward" else None,
                            version=1 if bug == "lag" else 3)
    if bug == "nan":
        trainer[0, 3] = float("nan")
    gate = {"bad_messages_delta": 2, "recent_errors": [("w0", "e0-p1-s0: non-finite rollout logprobs")]} if bug == "gate" else None
    kinds = {a.kind for a in det.check(_record(batch, trainer, accepted=bug != "reject"), gate)}
    assert kind in kinds
    if bug == "shift":
        assert "ratio_tail" not in kinds  # exp(0.3) = 1.35 is inside [0.5, 2)


def test_shift_detectors_keep_firing_on_a_persisting_fault():
    det = AnomalyDetectors(DebugConfig(), max_staleness=None)
    _healthy_history(det)
    for _ in range(30):  # the fault must not become the window's normal
        batch, trainer = _batch(rewards=500.0)
        assert "reward_shift" in {a.kind for a in det.check(_record(batch, trainer))}


def test_logprob_shift_ignores_exact_on_policy_batches_of_an_async_run():
    # A healthy max_staleness=1 run: the first steps on-policy (the pipeline fills), later some batches fully
    # on-policy with trainer == engine bit for bit (diff 0), the others one version behind (diff ~0.3). Before,
    # the zeros filled the window, a firing batch is never added to it, and every off-policy batch fired
    # (136 of 150 steps of make run).
    det = AnomalyDetectors(DebugConfig(), max_staleness=1)
    for step in range(1, 41):
        on_policy = step <= 4 or step % 7 == 0
        batch, trainer = _batch(shift=0.0 if on_policy else 0.3 + 0.01 * (step % 5), version=3)
        assert [a.kind for a in det.check(_record(batch, trainer, version=3 if on_policy else 4, step=step))] == []
    batch, trainer = _batch(shift=100.0, version=3)  # a real jump of the off-policy level still fires
    assert "logprob_shift" in {a.kind for a in det.check(_record(batch, trainer, version=4, step=41))}


def test_debugger_dumps_with_provenance_and_appends_anomaly_lines(tmp_path):
    dbg = Debugger(tmp_path, 0, DebugConfig(), max_staleness=0, context={"model_dir": "m", "sampling": {}})
    batch, trainer = _batch()
    rec = dbg.observe(step=1, policy_version=3, batch=batch, trainer_logprobs=trainer, advantages=torch.zeros(8),
                      accepted=True, guard_reason="", loss=0.1, grad_norm=1.0, update_ratio=0.01)
    assert rec["anomalies"] == []
    batch, trainer = _batch(shift=0.5)
    rec = dbg.observe(step=2, policy_version=3, batch=batch, trainer_logprobs=trainer, advantages=torch.zeros(8),
                      accepted=True, guard_reason="", loss=0.1, grad_norm=1.0, update_ratio=0.01,
                      weights=lambda: [torch.ones(3)])
    dbg.close()
    assert rec["anomalies"] and rec["anomalies"][0]["dump"] == "dumps/step-000002-rank0.msgpack"
    kind, body = read_dump(tmp_path / rec["anomalies"][0]["dump"])
    assert kind == "anomaly_batch" and body["uids"] == batch["uids"] and body["model_dir"] == "m"
    assert torch.equal(body["trainer_logprobs"], trainer) and len(body["weights"]["sha256"]) == 64
    assert [r["step"] for r in read_records(tmp_path / "debug" / "steps-rank0.jsonl")] == [1, 2]
    assert (tmp_path / "debug" / "anomalies.jsonl").read_text().count("\n") == len(rec["anomalies"])


def test_worker_faults_corrupt_what_they_say():
    c = Completion(prompt_ids=torch.tensor([1]), response_ids=torch.tensor([5, 6, 7]),
                   logprobs=torch.tensor([-1.0, -2.0, -3.0]), finish_reason="stop", policy_version=4)
    faults.corrupt_completion(FaultConfig(kind="shift_logprobs"), c)
    assert c.logprobs.tolist() == [0.0, -1.0, -2.0]
    faults.corrupt_completion(FaultConfig(kind="nan_logprobs"), c)
    assert math.isnan(c.logprobs[1])
    assert faults.corrupt_reward(FaultConfig(kind="exploding_reward", scale=10), 0.5) == 5.0
    fault = FaultConfig(kind="nan_logprobs", from_version=4, fraction=0.5)
    assert not faults.affects_group(fault, "e0-p1", 7, policy_version=3)
    hits = sum(faults.affects_group(fault, f"e0-p{i}", 1, policy_version=4) for i in range(400))
    assert 140 < hits < 260
    assert faults.skips_weights(FaultConfig(kind="stale_weights", from_version=2), 2)
    assert not faults.skips_weights(FaultConfig(kind="stale_weights", from_version=2), 1)


def test_fault_windows_chain_in_turn_and_may_not_overlap():
    """One run can inject several faults in turn (the debugger's recipe test does): each is active in its window
    only, the next one after it, healthy versions in between."""
    chain = FaultConfig(kind="exploding_reward", from_version=4, until_version=5, then=FaultConfig(
        kind="shift_logprobs", from_version=6, until_version=7, then=FaultConfig(kind="stale_weights", from_version=8)))
    assert [getattr(faults.active(chain, v), "kind", None) for v in range(10)] == [
        None, None, None, None, "exploding_reward", None, "shift_logprobs", None, "stale_weights", "stale_weights"]
    assert faults.affects_group(chain, "e0-p1", 1, policy_version=4) and not faults.affects_group(chain, "e0-p1", 1, 5)
    assert [faults.skips_weights(chain, v) for v in (6, 7, 8, 12)] == [False, False, True, True]
    with pytest.raises(ValueError, match="must be above"):
        FaultConfig(kind="nan_logprobs", from_version=4, until_version=4)
    with pytest.raises(ValueError, match="may not overlap"):
        FaultConfig(kind="nan_logprobs", from_version=4, then=FaultConfig(kind="shift_logprobs", from_version=6))
    with pytest.raises(ValueError, match="may not overlap"):
        FaultConfig(kind="nan_logprobs", from_version=4, until_version=7,
                    then=FaultConfig(kind="shift_logprobs", from_version=6))
